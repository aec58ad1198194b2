package dev.cbserve.client;

import cbserve.v1.Generation;
import cbserve.v1.GenerationServiceGrpc;
import cbserve.v1.Types;
import io.grpc.stub.ClientCallStreamObserver;
import io.grpc.stub.ClientResponseObserver;
import io.grpc.stub.StreamObserver;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.concurrent.ConcurrentHashMap;
import java.util.function.Function;

/**
 * Many requests on one {@code Generate} call, whose chunks the server sends batched: one message
 * for all the chunks of an engine step ({@code GenerateStreamOptions.batch_chunks}), where {@link
 * CbserveClient#stream} costs a message per request and step, and a call per request. Made by
 * {@link CbserveClient#session()}; for a process that keeps many requests in flight at one server
 * (a batch job, an RL rollout).
 *
 * <pre>{@code
 * try (GenerateSession session = client.session()) {
 *   Completion c = session.generate(Prompt.text("Hello"), params);   // from any thread
 *   try (ChunkIterator chunks = session.stream(Prompt.text("Once upon a time"), params)) {
 *     for (Chunk chunk : chunks) {
 *       System.out.print(chunk.text());
 *     }
 *   }
 * }
 * }</pre>
 *
 * <p>Thread-safe: any thread may call {@code stream}, {@code generate} and {@code generateN}. The
 * call goes to a replica as {@code stream}'s does (one whose health says SERVING, else any
 * replica, which says why it does not serve, or serves), and every request of the session goes to
 * that replica; none is retried (spread requests over replicas with {@link CbserveClient#stream}).
 * A request's chunks wait in its {@link ChunkIterator} until read: a slow reader never holds up
 * the others. Closing a request's iterator before it ended cancels that request only. A refused
 * request throws its {@link CbserveException} from its iterator; the session goes on. When the
 * call fails (the server stops, the connection drops), every unfinished request throws the error,
 * and the session takes no new one. {@link #close()} ends the call: the server cancels the
 * unfinished requests and frees their KV blocks, and their iterators throw {@link
 * CancelledException}.
 *
 * <p>Deadlines: the call has none; each request's ({@link RequestOptions#timeout()}, else the
 * client's {@code streamTimeout}) bounds that request alone, which is cancelled when it passes.
 */
public final class GenerateSession implements AutoCloseable, ChunkIterator.SessionRequests {
  /** The session's first message: every chunk that is ready at once comes in one message. */
  private static final Generation.GenerateRequest BATCHED_CHUNKS =
      Generation.GenerateRequest.newBuilder()
          .setOptions(Generation.GenerateStreamOptions.newBuilder().setBatchChunks(true))
          .build();

  /** The client's stubs: false for its health-checked channel, true for any replica (or null). */
  private final Function<Boolean, GenerationServiceGrpc.GenerationServiceStub> stubs;

  private final Map<String, String> headers;
  private final Duration streamTimeout;
  /** The open requests' iterators, by request id, for the call's chunks to go to. */
  private final Map<String, ChunkIterator> open = new ConcurrentHashMap<>();

  private final Object lock = new Object();
  // Guarded by lock: the try of the call that counts, its request stream, what it sent, and why
  // the call ended.
  private int attempt;
  private StreamObserver<Generation.GenerateRequest> out;
  private ClientCallStreamObserver<Generation.GenerateRequest> control;
  /**
   * The messages sent until the server answers (null after): a call that found no replica serving
   * is made again on any replica with all of them.
   */
  private List<Generation.GenerateRequest> sent = new ArrayList<>(List.of(BATCHED_CHUNKS));

  private boolean anyReplica;
  private CbserveException error;
  private boolean closed;

  GenerateSession(
      Function<Boolean, GenerationServiceGrpc.GenerationServiceStub> stubs,
      Map<String, String> headers,
      Duration streamTimeout) {
    this.stubs = stubs;
    this.headers = headers;
    this.streamTimeout = streamTimeout;
    synchronized (lock) {
      start(stubs.apply(false));
    }
  }

  /** Starts try number {@link #attempt} of the call on {@code stub}, sending {@link #sent}. */
  private void start(GenerationServiceGrpc.GenerationServiceStub stub) {
    out = Calls.withHeaders(stub, headers).generate(observer(attempt));
    for (Generation.GenerateRequest message : sent) {
      out.onNext(message);
    }
  }

  private ClientResponseObserver<Generation.GenerateRequest, Generation.GenerateResponse> observer(
      int tryNumber) {
    return new ClientResponseObserver<>() {
      @Override
      public void beforeStart(ClientCallStreamObserver<Generation.GenerateRequest> requestStream) {
        control = requestStream; // in start(), under the lock
      }

      @Override
      public void onNext(Generation.GenerateResponse response) {
        synchronized (lock) {
          if (tryNumber != attempt) {
            return;
          }
          sent = null;
        }
        for (Types.GenerationChunk chunk : response.getChunksList()) {
          ChunkIterator chunks = open.get(chunk.getRequestId());
          if (chunks != null) {
            chunks.deliver(Convert.chunk(chunk));
          }
        }
      }

      @Override
      public void onError(Throwable t) {
        CbserveException mapped = Calls.map(t);
        synchronized (lock) {
          if (tryNumber != attempt || madeAgain(mapped)) {
            return;
          }
        }
        end(mapped);
      }

      @Override
      public void onCompleted() {
        synchronized (lock) {
          if (tryNumber != attempt) {
            return;
          }
        }
        end(new CancelledException("the session's call ended", null));
      }
    };
  }

  /**
   * Whether the failed call is made again, on any replica: when it found no replica serving, before
   * the server answered (the client's rule for every call: see {@link ChunkIterator}).
   */
  private boolean madeAgain(CbserveException failure) {
    if (closed || sent == null || anyReplica || !Calls.noReplicaServing(failure)) {
      return false;
    }
    GenerationServiceGrpc.GenerationServiceStub any = stubs.apply(true);
    if (any == null) {
      return false;
    }
    anyReplica = true;
    attempt++;
    start(any);
    return true;
  }

  /** The call has ended: every open request fails with {@code failure}, or the closing's error. */
  private void end(CbserveException failure) {
    CbserveException ending;
    List<ChunkIterator> unfinished;
    synchronized (lock) {
      ending = closed ? new CancelledException("the session was closed", null) : failure;
      error = ending;
      unfinished = new ArrayList<>(open.values());
      open.clear();
    }
    for (ChunkIterator chunks : unfinished) {
      chunks.fail(ending);
    }
  }

  /** Sends a message on the call, unless it has ended or the session is closed. */
  private void send(Generation.GenerateRequest message) {
    synchronized (lock) {
      if (closed || error != null) {
        return;
      }
      if (sent != null) {
        sent.add(message);
      }
      out.onNext(message);
    }
  }

  // -- stream / generate ----------------------------------------------------------------------

  /**
   * Streams a completion with the server's default sampling; see {@link #stream(Prompt,
   * SamplingParams, RequestOptions)}.
   */
  public ChunkIterator stream(Prompt prompt) {
    return stream(prompt, SamplingParams.defaults(), RequestOptions.defaults());
  }

  /** Streams a completion; see {@link #stream(Prompt, SamplingParams, RequestOptions)}. */
  public ChunkIterator stream(Prompt prompt, SamplingParams params) {
    return stream(prompt, params, RequestOptions.defaults());
  }

  /**
   * Queues a request on the session and returns its chunks' iterator at once, the chunks {@link
   * CbserveClient#stream(Prompt, SamplingParams, RequestOptions)} gives. Closing the iterator
   * before the request ended cancels the request (all its sequences); the session goes on.
   *
   * @throws IllegalArgumentException for a request id that an open request of this session has,
   *     or for {@link RequestOptions#headers()} (a session's requests share its call's headers:
   *     pass them to {@link CbserveClient#session(Map)})
   * @throws CbserveException the error that ended the session's call, once it has ended ({@link
   *     CancelledException} once the session is closed)
   */
  public ChunkIterator stream(Prompt prompt, SamplingParams params, RequestOptions options) {
    return add(CbserveClient.request(prompt, params, options), options, params.n());
  }

  /**
   * Generates a completion with the server's default sampling; see {@link #generate(Prompt,
   * SamplingParams, RequestOptions)}.
   */
  public Completion generate(Prompt prompt) {
    return generate(prompt, SamplingParams.defaults(), RequestOptions.defaults());
  }

  /** Generates a completion; see {@link #generate(Prompt, SamplingParams, RequestOptions)}. */
  public Completion generate(Prompt prompt, SamplingParams params) {
    return generate(prompt, params, RequestOptions.defaults());
  }

  /**
   * Generates a completion on the session and returns it whole, as {@link
   * CbserveClient#generate(Prompt, SamplingParams, RequestOptions)} does (never retried).
   *
   * @throws IllegalArgumentException when {@code params} set n &gt; 1 (use {@code generateN}),
   *     and as {@link #stream(Prompt, SamplingParams, RequestOptions)}
   */
  public Completion generate(Prompt prompt, SamplingParams params, RequestOptions options) {
    CbserveClient.checkSingle(params, "generate");
    return CbserveClient.collect(stream(prompt, params, options), 1).get(0);
  }

  /**
   * Samples {@code n} completions of {@code prompt} in one request on the session, as {@link
   * CbserveClient#generateN(Prompt, int, SamplingParams, RequestOptions)} does (never retried).
   */
  public List<Completion> generateN(
      Prompt prompt, int n, SamplingParams params, RequestOptions options) {
    return CbserveClient.collect(
        add(CbserveClient.requestN(prompt, n, params, options), options, n), n);
  }

  /** {@link #generateN(Prompt, int, SamplingParams, RequestOptions)} with default options. */
  public List<Completion> generateN(Prompt prompt, int n, SamplingParams params) {
    return generateN(prompt, n, params, RequestOptions.defaults());
  }

  private ChunkIterator add(
      Types.GenerationRequest request, RequestOptions options, Integer sequences) {
    if (!options.headers().isEmpty()) {
      throw new IllegalArgumentException(
          "RequestOptions.headers: a session's requests share its call's headers; pass them to"
              + " client.session(headers)");
    }
    String id = request.getRequestId();
    CallTimeout timeout = CallTimeout.of(options.timeout(), streamTimeout, "streamTimeout");
    ChunkIterator chunks =
        ChunkIterator.ofSession(id, timeout, sequences == null ? 1 : sequences, this);
    synchronized (lock) {
      if (error != null) {
        throw error;
      }
      if (closed) {
        throw new CancelledException("the session was closed", null);
      }
      if (open.putIfAbsent(id, chunks) != null) {
        throw new IllegalArgumentException(
            "request id " + id + " is in use by a request of this session");
      }
      send(Generation.GenerateRequest.newBuilder().setAdd(request).build());
    }
    return chunks;
  }

  /** Asks the server to cancel one request of the session (idempotent). */
  @Override
  public void cancel(String requestId) {
    Objects.requireNonNull(requestId, "requestId");
    send(
        Generation.GenerateRequest.newBuilder()
            .setCancel(Generation.GenerateCancel.newBuilder().setRequestId(requestId))
            .build());
  }

  @Override
  public void forget(String requestId) {
    open.remove(requestId);
  }

  /**
   * Ends the call: the server cancels the session's unfinished requests, whose iterators throw
   * {@link CancelledException}. Idempotent.
   */
  @Override
  public void close() {
    synchronized (lock) {
      if (closed) {
        return;
      }
      closed = true;
      control.cancel("the session was closed", null);
    }
  }
}
