package dev.cbserve.client;

import cbserve.v1.Types;
import io.grpc.stub.ClientCallStreamObserver;
import io.grpc.stub.ClientResponseObserver;
import java.util.BitSet;
import java.util.Iterator;
import java.util.NoSuchElementException;
import java.util.concurrent.BlockingQueue;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.TimeUnit;
import java.util.function.Function;

/**
 * The chunks of one streaming call ({@link CbserveClient#stream} or {@link
 * CbserveClient#results}), or of one request of a {@link GenerateSession}, in order, as they
 * come. {@link #hasNext()} blocks until the next chunk arrives or the call ends; a failed call
 * throws the matching {@link CbserveException} from it.
 * With {@link SamplingParams.Builder#n(int) n} &gt; 1 the chunks of the n sequences come
 * interleaved ({@link Chunk#index()}), and the iterator ends once every sequence has sent its
 * terminal chunk, not after the first.
 *
 * <p>{@link #close()} cancels the call. For {@code stream} that cancels the request on the server
 * too (and frees its KV cache); for {@code results} it only stops reading (cancel the request with
 * {@link CbserveClient#cancel}); for a session's request it cancels that request only, unless it
 * has ended (the session goes on). Use it in try-with-resources, and read it with for-each (it is
 * its own {@link Iterable}, for one pass):
 *
 * <pre>{@code
 * try (ChunkIterator chunks = client.stream(Prompt.text("Once upon a time"), params)) {
 *   for (Chunk chunk : chunks) {
 *     System.out.print(chunk.text());
 *   }
 * }
 * }</pre>
 *
 * <p>One thread reads an iterator; {@code close()} may be called from any thread. At most a few
 * chunks are buffered: a slow reader slows the server's sending of this call (flow control).
 *
 * <p>A {@code stream} call that fails with {@link UnavailableException} before its first chunk (a
 * replica refused the request as still loading, draining or asleep, or its connection broke) is
 * made again, after a backoff, on the next ready replica, within the call's deadline: nothing was
 * read, and the server cancels the request of a Generate call that ends. A call ({@code stream} or
 * {@code results}) that found no replica serving is made again at once on a channel without health
 * checking, so that a replica answers it: with its reason, or by serving it.
 */
public final class ChunkIterator implements Iterator<Chunk>, Iterable<Chunk>, AutoCloseable {
  private static final int PREFETCH = 8;
  private static final Object END = new Object();

  /** A failed call, queued behind the chunks that came before it. */
  private record Failure(CbserveException error) {}

  /** What one try (one call) sent: a chunk, a {@link Failure} or {@link #END}. */
  private record Event(int attempt, Object payload) {}

  private final String requestId;
  private final boolean raiseRejections;
  private final CallTimeout timeout;
  private final int sequences;
  private final BitSet endedSequences = new BitSet();
  private final BlockingQueue<Event> events = new LinkedBlockingQueue<>();
  /** The session this iterator's request is made on, or null for a call of its own. */
  private final SessionRequests session;
  private volatile ClientCallStreamObserver<?> call;
  private volatile boolean closed;
  /** The try whose events count; a stale try's are dropped. */
  private volatile int attempt;
  private Retries retries;
  private Starter starter;
  /** Whether the tries go to any replica (not only SERVING ones): see {@link Starter}. */
  private boolean anyReplica;
  private boolean delivered;
  private Chunk next;
  private volatile boolean ended;
  private boolean iterated;

  /**
   * An iterator fed by {@link #observer}, of a request whose number of sequences is not known here:
   * it ends when the call completes (the server completes it once every sequence has ended).
   *
   * @param timeout the call's deadline (named in a {@link DeadlineExceededException}), or null
   */
  ChunkIterator(String requestId, boolean raiseRejections, CallTimeout timeout) {
    this(requestId, raiseRejections, timeout, 0);
  }

  /**
   * An iterator fed by {@link #observer}.
   *
   * @param timeout the call's deadline (named in a {@link DeadlineExceededException}), or null
   * @param sequences the request's number of sequences (n): the iterator ends once that many
   *     distinct sequences have sent their terminal chunk, or when the call completes; 0 when
   *     unknown (then only the call's completion ends it)
   */
  ChunkIterator(String requestId, boolean raiseRejections, CallTimeout timeout, int sequences) {
    this(requestId, raiseRejections, timeout, sequences, null);
  }

  private ChunkIterator(
      String requestId,
      boolean raiseRejections,
      CallTimeout timeout,
      int sequences,
      SessionRequests session) {
    this.requestId = requestId;
    this.raiseRejections = raiseRejections;
    this.timeout = timeout;
    this.sequences = sequences;
    this.session = session;
  }

  /** What the iterator of a session's request needs of its session. */
  interface SessionRequests {
    /** Asks the server to cancel the request (idempotent). */
    void cancel(String requestId);

    /** The request's iterator has ended: the session hands it nothing more. */
    void forget(String requestId);
  }

  /**
   * The iterator of request {@code requestId} of {@code session}, fed by {@link #deliver} and
   * {@link #fail}: it ends after the terminal chunks of its {@code sequences} (at least 1), and
   * when {@code timeout} passes first it cancels the request and throws {@link
   * DeadlineExceededException}.
   */
  static ChunkIterator ofSession(
      String requestId, CallTimeout timeout, int sequences, SessionRequests session) {
    return new ChunkIterator(requestId, true, timeout, Math.max(1, sequences), session);
  }

  /** Hands a chunk of a session's request to its iterator. */
  void deliver(Chunk chunk) {
    events.add(new Event(0, chunk));
  }

  /** Ends a session's request with the error that ended the session's call. */
  void fail(CbserveException error) {
    events.add(new Event(0, new Failure(error)));
  }

  /** Starts try number {@code attempt} of the call, fed by {@link #observer(int, Function)}. */
  interface Starter {
    /**
     * Starts the try, on the client's health-checked channel, or with {@code anyReplica} on its
     * channel without health checking; false when it has none (the try is not started).
     */
    boolean start(int attempt, boolean anyReplica);
  }

  /**
   * Makes the call again, as try number 1, 2, ... with {@code starter}, when it fails before its
   * first chunk: at once on any replica when no replica served it, and after a backoff on {@link
   * UnavailableException} as long as {@code retries} allows (null: never).
   */
  void retryWith(Retries retries, Starter starter) {
    this.retries = retries;
    this.starter = starter;
  }

  /** The observer to start the call with; it feeds this iterator. */
  <ReqT, RespT> ClientResponseObserver<ReqT, RespT> observer(
      Function<RespT, Types.GenerationChunk> extract) {
    return observer(0, extract);
  }

  /** The observer of try number {@code tryNumber} (0 the first); it feeds this iterator. */
  <ReqT, RespT> ClientResponseObserver<ReqT, RespT> observer(
      int tryNumber, Function<RespT, Types.GenerationChunk> extract) {
    return new ClientResponseObserver<ReqT, RespT>() {
      @Override
      public void beforeStart(ClientCallStreamObserver<ReqT> requestStream) {
        if (tryNumber == attempt) {
          call = requestStream;
        }
        requestStream.disableAutoRequestWithInitial(PREFETCH);
        if (closed) {
          requestStream.cancel("closed by the client", null);
        }
      }

      @Override
      public void onNext(RespT value) {
        events.add(new Event(tryNumber, Convert.chunk(extract.apply(value))));
      }

      @Override
      public void onError(Throwable t) {
        events.add(new Event(tryNumber, new Failure(Calls.map(t, timeout))));
      }

      @Override
      public void onCompleted() {
        events.add(new Event(tryNumber, END));
      }
    };
  }

  /**
   * This iterator, for a for-each loop. The chunks are read once: a second call throws (a new
   * call to the server is what reading them again takes).
   *
   * @throws IllegalStateException on a second call
   */
  @Override
  public Iterator<Chunk> iterator() {
    if (iterated) {
      throw new IllegalStateException(
          "the chunks of request " + requestId + " can be iterated once; call results(requestId,"
              + " fromIndex) to read them again");
    }
    iterated = true;
    return this;
  }

  /** The id of the request this iterator follows. */
  public String requestId() {
    return requestId;
  }

  /**
   * Waits for the next chunk. Returns false once the request has ended and the stream has nothing
   * more (after the request's terminal chunk; with n &gt; 1, after the terminal chunks of all n
   * sequences, one per index), or after {@link #close()}.
   *
   * @throws CbserveException when the call failed (e.g. {@link NotFoundException} for an unknown
   *     id, {@link InvalidArgumentException} for a rejected prompt, {@link
   *     DeadlineExceededException}); {@link CancelledException} when the thread is interrupted
   *     (the call is then cancelled and the interrupt flag kept)
   */
  @Override
  public boolean hasNext() {
    if (next != null) {
      return true;
    }
    while (!ended) {
      if (closed || (sequences > 0 && endedSequences.cardinality() >= sequences)) {
        end();
        break;
      }
      Event tagged = take();
      if (tagged.attempt() != attempt) {
        continue; // from a try that failed and was made again
      }
      Object event = tagged.payload();
      if (event == END) {
        end();
      } else if (event instanceof Failure failure) {
        if (closed) {
          end();
        } else if (!retried(failure.error())) {
          end();
          throw failure.error();
        }
      } else {
        if (call != null) {
          call.request(1);
        }
        Chunk chunk = (Chunk) event;
        CbserveException rejected = raiseRejections ? Calls.rejection(chunk) : null;
        if (rejected != null) {
          if (retried(rejected)) {
            continue;
          }
          end();
          close();
          throw rejected;
        }
        if (chunk.isFinished() && chunk.index() >= 0 && requestId.equals(chunk.requestId())) {
          endedSequences.set(chunk.index()); // counted per index: a sequence ends once
        }
        delivered = true;
        next = chunk;
        return true;
      }
    }
    return false;
  }

  /** The next chunk (waits for it); see {@link #hasNext()}. */
  @Override
  public Chunk next() {
    if (!hasNext()) {
      throw new NoSuchElementException("the stream of request " + requestId + " has ended");
    }
    Chunk chunk = next;
    next = null;
    return chunk;
  }

  /**
   * Whether the failed try is made again: on {@link UnavailableException} before the first chunk,
   * after the backoff, while tries and time are left. The failed call is cancelled (a refused
   * request's call ends by itself; cancelling it is harmless).
   */
  private boolean retried(CbserveException error) {
    if (delivered || starter == null || closed) {
      return false;
    }
    ClientCallStreamObserver<?> failed = call;
    if (Calls.noReplicaServing(error) && !anyReplica) {
      anyReplica = true; // not a try of its own: a replica says why it does not serve, or serves
      return restart(failed);
    }
    if (!(error instanceof UnavailableException) || retries == null) {
      return false;
    }
    return retries.awaitNext() && !closed && restart(failed);
  }

  private boolean restart(ClientCallStreamObserver<?> failed) {
    if (failed != null) {
      failed.cancel("made again on another replica", null);
    }
    attempt++;
    return starter.start(attempt, anyReplica);
  }

  /**
   * Cancels the call (no-op once it has completed), or a session's request unless it has ended;
   * idempotent, callable from any thread.
   */
  @Override
  public void close() {
    if (closed) {
      return;
    }
    closed = true;
    if (session != null) {
      if (!ended) {
        session.cancel(requestId);
      }
      session.forget(requestId);
      return;
    }
    ClientCallStreamObserver<?> c = call;
    if (c != null) {
      c.cancel("closed by the client", null);
    }
  }

  /** The stream has nothing more: a session hands this iterator no more chunks. */
  private void end() {
    ended = true;
    if (session != null) {
      session.forget(requestId);
    }
  }

  /**
   * The next event. A session's request waits no longer than its deadline (its call has none):
   * then the request is cancelled.
   */
  private Event take() {
    try {
      if (session == null || timeout.duration() == null) {
        return events.take();
      }
      Event event = events.poll(timeout.leftNanos(), TimeUnit.NANOSECONDS);
      if (event == null) {
        close();
        end();
        throw new DeadlineExceededException(
            "request " + requestId + " was cancelled: " + timeout.explanation());
      }
      return event;
    } catch (InterruptedException e) {
      close();
      end();
      Thread.currentThread().interrupt();
      throw new CancelledException("interrupted while waiting for the next chunk", e);
    }
  }
}
