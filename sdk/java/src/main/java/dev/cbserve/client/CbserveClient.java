package dev.cbserve.client;

import cbserve.v1.Generation;
import cbserve.v1.GenerationServiceGrpc;
import cbserve.v1.Types;
import io.grpc.ChannelCredentials;
import io.grpc.ManagedChannel;
import io.grpc.stub.ClientCallStreamObserver;
import io.grpc.stub.ClientResponseObserver;
import io.grpc.stub.StreamObserver;
import java.nio.file.Path;
import java.time.Duration;
import java.util.Arrays;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicReference;
import java.util.function.Function;

/**
 * A connection to a cbserve server's {@code GenerationService}. Thread-safe; close it when done
 * (in-flight calls are then cancelled).
 *
 * <pre>{@code
 * try (CbserveClient client = CbserveClient.builder().target("127.0.0.1:50051").build()) {
 *   Completion c = client.generate(Prompt.text("Hello"),
 *       SamplingParams.builder().maxNewTokens(16).temperature(0).build());
 *   System.out.println(c.text());
 * }
 * }</pre>
 *
 * <p>{@code generate} and {@code stream} run on the bidirectional {@code Generate} RPC, so the
 * request lives as long as the call: closing a {@link ChunkIterator}, cancelling a future of
 * {@code generateAsync}, or losing the connection cancels the request on the server and frees its
 * KV cache. {@code submit} ({@code AddRequest}) queues a request that lives on its own; read it
 * with {@code results} ({@code StreamResults}, resumable from any token index) and stop it with
 * {@code cancel}.
 *
 * <p>Parallel sampling: {@code generateN(prompt, n, params)} samples n completions of one prompt in
 * one request ({@link SamplingParams.Builder#n(int)}: the prompt is computed once), returned in
 * order of their index; {@code stream} with n set interleaves the sequences' chunks ({@link
 * Chunk#index()}); {@code cancelSequence(requestId, index)} stops one sequence.
 *
 * <p>Deadlines: unary calls ({@code submit}, {@code cancel}, {@code cancelSequence}, {@code
 * modelInfo}) get the builder's {@code defaultTimeout} (60 s unless set); streaming calls ({@code
 * generate}, {@code generateN}, {@code stream}, {@code results}) its {@code streamTimeout} (10 min
 * unless set); {@link RequestOptions#timeout()} or the {@code timeout} argument overrides either
 * for one call. {@code modelInfo}, {@code cancel} and {@code cancelSequence} are retried on
 * UNAVAILABLE with exponential backoff (gRPC's retry policy, within the deadline); so are {@code
 * generate}, {@code generateN} and {@code stream} where nothing ran (see {@link #stream(Prompt,
 * SamplingParams, RequestOptions)}). Several servers: {@link Builder#targets(String...)} or a
 * {@code dns:///} name that resolves to several addresses; calls are spread round-robin over
 * those whose {@code grpc.health.v1} status is SERVING. Failures throw {@link CbserveException}
 * subclasses (unchecked); a request rejected on the Generate stream throws as if {@code AddRequest}
 * had rejected it, while a request that fails while running ends with {@link FinishReason#ERROR}
 * and {@link Completion#error()}.
 */
public final class CbserveClient implements AutoCloseable {
  private final ManagedChannel channel;
  private final boolean ownsChannel;
  private final Duration defaultTimeout;
  private final Duration streamTimeout;
  private final GenerationServiceGrpc.GenerationServiceStub asyncStub;
  private final GenerationServiceGrpc.GenerationServiceBlockingStub blockingStub;
  /**
   * The options of a channel like the client's but without health checking (null when the builder
   * was given a channel). A call that finds no replica serving is made again on it, so that a
   * replica answers it: with its own reason (the model is still loading, the server is asleep,
   * ...), or by serving it, having turned SERVING before the client's health watch said so.
   */
  private final ChannelOptions anyReplicaOptions;
  private final ChannelOptions adminOptions;
  private ManagedChannel anyReplicaChannel;
  private CbserveAdminClient admin;
  private boolean closed;

  private CbserveClient(Builder builder) {
    this.channel = builder.options.build();
    this.ownsChannel = !builder.options.external();
    this.defaultTimeout = builder.options.defaultTimeout;
    this.streamTimeout = builder.options.streamTimeout;
    this.asyncStub = GenerationServiceGrpc.newStub(channel);
    this.blockingStub = GenerationServiceGrpc.newBlockingStub(channel);
    if (builder.options.external()) {
      this.anyReplicaOptions = null;
    } else {
      this.anyReplicaOptions = builder.options.copy();
      this.anyReplicaOptions.healthChecked = false;
    }
    if (builder.adminTarget != null) {
      ChannelOptions admin = builder.options.copy();
      admin.channel = null;
      admin.healthChecked = false;
      admin.target(builder.adminTarget);
      admin.token = builder.adminToken;
      this.adminOptions = admin;
    } else {
      this.adminOptions = null;
    }
  }

  /** A new builder; {@link Builder#target(String)} is required. */
  public static Builder builder() {
    return new Builder();
  }

  // -- generate / stream (bidirectional Generate RPC) ----------------------------------------

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
   * Generates a completion for {@code prompt} and returns it whole (blocks until the request
   * ends). One completion: for {@link SamplingParams.Builder#n(int) n} &gt; 1 completions of the
   * prompt call {@link #generateN(Prompt, int, SamplingParams, RequestOptions)}.
   *
   * @throws IllegalArgumentException when {@code params} set n &gt; 1 (use {@code generateN})
   * @throws InvalidArgumentException (and the other {@link CbserveException}s) when the server
   *     rejects the request; a request that fails while running returns a completion with {@link
   *     FinishReason#ERROR} instead
   */
  public Completion generate(Prompt prompt, SamplingParams params, RequestOptions options) {
    checkSingle(params, "generate");
    return generateAll(request(prompt, params, options), options, 1).get(0);
  }

  /**
   * Samples {@code n} completions of the prompt; see {@link #generateN(Prompt, int,
   * SamplingParams, RequestOptions)}.
   */
  public List<Completion> generateN(Prompt prompt, int n, SamplingParams params) {
    return generateN(prompt, n, params, RequestOptions.defaults());
  }

  /**
   * Samples {@code n} completions of {@code prompt} in one request (parallel sampling, {@link
   * SamplingParams.Builder#n(int)}) and returns them whole, ordered by {@link Completion#index()}
   * (blocks until every sequence has ended). The server computes the prompt once; each sequence
   * samples and stops on its own, so their lengths and finish reasons may differ. With a seed s,
   * completion i is the one a single request seeded with s + i would give. Cancel one sequence
   * while it runs with {@link #cancelSequence(String, int)} (from another thread, with the id set
   * in {@code options}); it then ends {@link FinishReason#CANCELLED} and the others run on.
   *
   * @param n the number of completions, 1 to {@link SamplingBounds#MAX_N}; {@code params} may set
   *     the same n, or leave it unset
   * @throws IllegalArgumentException when {@code n} is out of bounds, or differs from the n that
   *     {@code params} set
   * @throws InvalidArgumentException (and the other {@link CbserveException}s) when the server
   *     rejects the request
   */
  public List<Completion> generateN(
      Prompt prompt, int n, SamplingParams params, RequestOptions options) {
    return generateAll(requestN(prompt, n, params, options), options, n);
  }

  /**
   * The completions of the first {@code n} sequences of a Generate call for {@code request}. A
   * call that fails with {@link UnavailableException} is made again within the call's deadline
   * (see {@link #stream(Prompt, SamplingParams, RequestOptions)}): before its first chunk as
   * {@code stream} does, and also after, when its connection broke mid-request (a replica killed)
   * and the client chose the request's id: the caller has seen nothing, the server cancels the
   * request of a Generate call that ends, and the next try takes a fresh id, so a replica that
   * still holds the old request cannot refuse it as a duplicate.
   */
  private List<Completion> generateAll(
      Types.GenerationRequest request, RequestOptions options, int n) {
    CallTimeout timeout = CallTimeout.of(options.timeout(), streamTimeout, "streamTimeout");
    Retries retries = new Retries(timeout);
    while (true) {
      try {
        return collect(startStream(request, options, n, timeout, retries), n);
      } catch (UnavailableException e) {
        if (options.requestId() != null || !retries.awaitNext()) {
          throw e;
        }
        request = request.toBuilder().setRequestId(Calls.newRequestId()).build();
      }
    }
  }

  /** Reads a Generate stream until its first {@code n} sequences have ended, and closes it. */
  static List<Completion> collect(ChunkIterator stream, int n) {
    try (ChunkIterator chunks = stream) {
      SequencesBuilder builder = new SequencesBuilder(chunks.requestId(), n);
      while (!builder.done() && chunks.hasNext()) {
        builder.add(chunks.next());
      }
      return builder.build();
    }
  }

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
   * Starts generating and returns an iterator over the output chunks as they come: first a
   * {@link RequestStatus#QUEUED} chunk, then token deltas, then a terminal chunk. With {@link
   * SamplingParams.Builder#n(int) n} &gt; 1 every sequence streams such chunks, interleaved with
   * the others' ({@link Chunk#index()} says whose), and the iterator ends once all n have sent
   * their terminal chunk. Closing the iterator before the request ended cancels the request (all
   * its sequences) on the server.
   *
   * <p>A call that fails with {@link UnavailableException} before its first chunk (a replica
   * refused the request as still loading, draining or asleep, or its connection broke) is made
   * again, after a backoff, on the next ready replica: up to 4 tries within the call's deadline.
   * Nothing was read, and nothing runs on the replica that failed.
   */
  public ChunkIterator stream(Prompt prompt, SamplingParams params, RequestOptions options) {
    Types.GenerationRequest request = request(prompt, params, options);
    CallTimeout timeout = CallTimeout.of(options.timeout(), streamTimeout, "streamTimeout");
    return startStream(
        request, options, params.n() != null ? params.n() : 0, timeout, new Retries(timeout));
  }

  /**
   * Starts a Generate call for {@code request}, made again on UNAVAILABLE before its first chunk
   * as {@code retries} allows.
   *
   * @param sequences the request's n, or 0 when unset (the iterator then ends with the call)
   */
  private ChunkIterator startStream(
      Types.GenerationRequest request,
      RequestOptions options,
      int sequences,
      CallTimeout timeout,
      Retries retries) {
    ChunkIterator chunks = new ChunkIterator(request.getRequestId(), true, timeout, sequences);
    chunks.retryWith(
        retries,
        (attempt, anyReplica) -> {
          GenerationServiceGrpc.GenerationServiceStub stub = stub(anyReplica);
          if (stub != null) {
            startGenerate(
                stub,
                request,
                timeout,
                options,
                chunks.<Generation.GenerateRequest, Generation.GenerateResponse>observer(
                    attempt, Generation.GenerateResponse::getChunk));
          }
          return stub != null;
        });
    startGenerate(
        asyncStub,
        request,
        timeout,
        options,
        chunks.observer(Generation.GenerateResponse::getChunk));
    return chunks;
  }

  /**
   * Opens one {@code Generate} call for many requests, whose chunks the server sends batched, one
   * message per engine step: a {@link GenerateSession}, whose {@code stream} and {@code generate}
   * take the same arguments as the client's, from any thread. Close it when done (its unfinished
   * requests are then cancelled).
   */
  public GenerateSession session() {
    return session(Map.of());
  }

  /** {@link #session()}, with extra headers sent with the session's call. */
  public GenerateSession session(Map<String, String> headers) {
    return new GenerateSession(this::stub, Map.copyOf(headers), streamTimeout);
  }

  /** {@link #generate(Prompt)} without blocking. */
  public CompletableFuture<Completion> generateAsync(Prompt prompt) {
    return generateAsync(prompt, SamplingParams.defaults(), RequestOptions.defaults());
  }

  /** {@link #generate(Prompt, SamplingParams)} without blocking. */
  public CompletableFuture<Completion> generateAsync(Prompt prompt, SamplingParams params) {
    return generateAsync(prompt, params, RequestOptions.defaults());
  }

  /**
   * {@link #generate(Prompt, SamplingParams, RequestOptions)} without blocking: the future
   * completes with the completion, or exceptionally with a {@link CbserveException}. Cancelling
   * the future cancels the request on the server. Dependent stages run on gRPC's executor unless
   * given one ({@code thenApplyAsync(fn, executor)}).
   *
   * @throws IllegalArgumentException when {@code params} set n &gt; 1 (use {@code
   *     generateNAsync})
   */
  public CompletableFuture<Completion> generateAsync(
      Prompt prompt, SamplingParams params, RequestOptions options) {
    checkSingle(params, "generateAsync");
    // The future the caller gets is the call's own, so that cancelling it cancels the call.
    return collectAsync(request(prompt, params, options), options, 1, list -> list.get(0));
  }

  /**
   * {@link #generateN(Prompt, int, SamplingParams)} without blocking; see {@link
   * #generateNAsync(Prompt, int, SamplingParams, RequestOptions)}.
   */
  public CompletableFuture<List<Completion>> generateNAsync(
      Prompt prompt, int n, SamplingParams params) {
    return generateNAsync(prompt, n, params, RequestOptions.defaults());
  }

  /**
   * {@link #generateN(Prompt, int, SamplingParams, RequestOptions)} without blocking: the future
   * completes with the n completions, ordered by index, once every sequence has ended, or
   * exceptionally with a {@link CbserveException}. Cancelling the future cancels the request (all
   * its sequences) on the server.
   *
   * @throws IllegalArgumentException when {@code n} is out of bounds, or differs from the n that
   *     {@code params} set
   */
  public CompletableFuture<List<Completion>> generateNAsync(
      Prompt prompt, int n, SamplingParams params, RequestOptions options) {
    return collectAsync(requestN(prompt, n, params, options), options, n, Function.identity());
  }

  /**
   * Starts a Generate call; the future completes with {@code result} of the completions once the
   * first {@code n} sequences have ended. Cancelling the future cancels the call. A call that fails
   * with {@link UnavailableException} is made again as {@link #generateAll} makes it.
   */
  private <T> CompletableFuture<T> collectAsync(
      Types.GenerationRequest request,
      RequestOptions options,
      int n,
      Function<List<Completion>, T> result) {
    CompletableFuture<T> future = new CompletableFuture<>();
    AtomicReference<ClientCallStreamObserver<?>> current = new AtomicReference<>();
    future.whenComplete(
        (value, error) -> {
          ClientCallStreamObserver<?> call = current.get();
          if (future.isCancelled() && call != null) {
            call.cancel("cancelled by the caller", null);
          }
        });
    CallTimeout timeout = CallTimeout.of(options.timeout(), streamTimeout, "streamTimeout");
    attemptAsync(
        request, options, n, result, future, current, timeout, new Retries(timeout), false);
    return future;
  }

  /** One try of {@link #collectAsync}. */
  private <T> void attemptAsync(
      Types.GenerationRequest request,
      RequestOptions options,
      int n,
      Function<List<Completion>, T> result,
      CompletableFuture<T> future,
      AtomicReference<ClientCallStreamObserver<?>> current,
      CallTimeout timeout,
      Retries retries,
      boolean anyReplica) {
    if (future.isDone()) {
      return;
    }
    String requestId = request.getRequestId();
    SequencesBuilder builder = new SequencesBuilder(requestId, n);
    startGenerate(
        stub(anyReplica),
        request,
        timeout,
        options,
        new ClientResponseObserver<Generation.GenerateRequest, Generation.GenerateResponse>() {
          /** Whether this try has ended (it failed, or the future is complete). */
          private boolean over;

          private boolean received;

          @Override
          public void beforeStart(ClientCallStreamObserver<Generation.GenerateRequest> stream) {
            current.set(stream);
            if (future.isCancelled()) {
              stream.cancel("cancelled by the caller", null);
            }
          }

          @Override
          public void onNext(Generation.GenerateResponse response) {
            if (over || future.isDone()) {
              return;
            }
            Chunk chunk = Convert.chunk(response.getChunk());
            if (!chunk.requestId().equals(requestId)) {
              return;
            }
            // A rejected request has ended on the server, and the call is half-closed as soon as
            // it starts, so the server ends the call by itself: cancelling here could race the
            // half-close in startGenerate (which then throws "call was cancelled").
            CbserveException rejected = Calls.rejection(chunk);
            if (rejected != null) {
              fail(rejected);
              return;
            }
            received = true;
            try {
              builder.add(chunk);
              if (builder.done()) {
                over = true;
                future.complete(result.apply(builder.build()));
              }
            } catch (CbserveException e) {
              over = true;
              future.completeExceptionally(e);
            }
          }

          @Override
          public void onError(Throwable t) {
            if (!over) {
              fail(Calls.map(t, timeout));
            }
          }

          @Override
          public void onCompleted() {
            if (!over && !future.isDone()) {
              over = true;
              try {
                future.complete(result.apply(builder.build()));
              } catch (CbserveException e) {
                future.completeExceptionally(e);
              }
            }
          }

          /** Makes the call again where {@link #generateAll} would, else fails the future. */
          private void fail(CbserveException error) {
            over = true;
            if (Calls.noReplicaServing(error) && !anyReplica && stub(true) != null) {
              // Not a try of its own: a replica says why it does not serve, or serves.
              attemptAsync(request, options, n, result, future, current, timeout, retries, true);
              return;
            }
            boolean again =
                error instanceof UnavailableException
                    && (!received || options.requestId() == null);
            long delay = again ? retries.nextDelayNanos() : -1;
            if (delay < 0) {
              future.completeExceptionally(error);
              return;
            }
            Types.GenerationRequest next =
                received ? request.toBuilder().setRequestId(Calls.newRequestId()).build() : request;
            CompletableFuture.delayedExecutor(delay, TimeUnit.NANOSECONDS)
                .execute(
                    () ->
                        attemptAsync(
                            next, options, n, result, future, current, timeout, retries,
                            anyReplica));
          }
        });
  }

  /** Refuses parameters of n &gt; 1 in a call that returns one completion. */
  static void checkSingle(SamplingParams params, String method) {
    Objects.requireNonNull(params, "params");
    Integer n = params.n();
    if (n != null && n > 1) {
      String multi = method.equals("generate") ? "generateN" : "generateNAsync";
      throw new IllegalArgumentException(
          method + " returns one completion, but params set n = " + n + ": call " + multi
              + "(prompt, " + n + ", params) for all " + n + " (or stream(prompt, params) to read"
              + " them as they come)");
    }
  }

  /** The GenerationRequest of a generateN call: {@code request(...)} with sampling.n set. */
  static Types.GenerationRequest requestN(
      Prompt prompt, int n, SamplingParams params, RequestOptions options) {
    SamplingParams.Builder.checkN(n);
    Objects.requireNonNull(params, "params");
    Integer set = params.n();
    if (set != null && set != n) {
      throw new IllegalArgumentException(
          "generateN was asked for n = " + n + ", but params set n = " + set
              + " (leave n unset in params, or pass the same value)");
    }
    Types.GenerationRequest request = request(prompt, params, options);
    return request.toBuilder().setSampling(request.getSampling().toBuilder().setN(n)).build();
  }

  private static void startGenerate(
      GenerationServiceGrpc.GenerationServiceStub stub,
      Types.GenerationRequest request,
      CallTimeout timeout,
      RequestOptions options,
      ClientResponseObserver<Generation.GenerateRequest, Generation.GenerateResponse> observer) {
    StreamObserver<Generation.GenerateRequest> out =
        Calls.withTimeout(Calls.withHeaders(stub, options.headers()), timeout).generate(observer);
    out.onNext(Generation.GenerateRequest.newBuilder().setAdd(request).build());
    // Half-close: the server keeps the call (and the request) until the request ends.
    out.onCompleted();
  }

  // -- submit / results / cancel ------------------------------------------------------------

  /**
   * Queues a request with the server's default sampling; see {@link #submit(Prompt, SamplingParams,
   * RequestOptions)}.
   */
  public String submit(Prompt prompt) {
    return submit(prompt, SamplingParams.defaults(), RequestOptions.defaults());
  }

  /** Queues a request; see {@link #submit(Prompt, SamplingParams, RequestOptions)}. */
  public String submit(Prompt prompt, SamplingParams params) {
    return submit(prompt, params, RequestOptions.defaults());
  }

  /**
   * Queues a request ({@code AddRequest}) and returns its id without waiting for any output; read
   * the outputs with {@link #results(String, int)}. The request lives on its own (closing nothing
   * cancels it: use {@link #cancel(String)}). Retried (3 tries, exponential backoff from 100 ms)
   * on {@link UnavailableException} and {@link ResourceExhaustedException}, which mean that
   * nothing was queued; the request id is chosen client-side when not given, so a retry never
   * queues a request twice. {@code options.timeout()} (else the default timeout) bounds all tries.
   */
  public String submit(Prompt prompt, SamplingParams params, RequestOptions options) {
    Types.GenerationRequest request = request(prompt, params, options);
    Generation.AddRequestRequest message =
        Generation.AddRequestRequest.newBuilder().setRequest(request).build();
    CallTimeout timeout = CallTimeout.of(options.timeout(), defaultTimeout, "defaultTimeout");
    long deadline =
        timeout.duration() == null ? Long.MAX_VALUE : System.nanoTime() + timeout.leftNanos();
    for (int attempt = 0; ; attempt++) {
      try {
        return blocking(
                timeout, stub -> Calls.withHeaders(stub, options.headers()).addRequest(message))
            .getRequestId();
      } catch (CbserveException e) {
        if (attempt > 0 && e instanceof AlreadyExistsException) {
          return request.getRequestId(); // an earlier try queued it; its answer was lost
        }
        long delay = Calls.backoffNanos(attempt);
        boolean timeLeft =
            deadline == Long.MAX_VALUE || deadline - System.nanoTime() > delay;
        if (!Calls.retryable(e) || attempt == Calls.SUBMIT_ATTEMPTS - 1 || !timeLeft) {
          throw e;
        }
        try {
          TimeUnit.NANOSECONDS.sleep(delay);
        } catch (InterruptedException interrupted) {
          Thread.currentThread().interrupt();
          throw new CancelledException("interrupted while retrying", interrupted);
        }
      }
    }
  }

  /** {@link #submit(Prompt, SamplingParams)} without blocking. */
  public CompletableFuture<String> submitAsync(Prompt prompt, SamplingParams params) {
    return submitAsync(prompt, params, RequestOptions.defaults());
  }

  /**
   * {@link #submit(Prompt, SamplingParams, RequestOptions)} without blocking (same retries);
   * cancelling the future stops the retries and cancels the call in flight.
   */
  public CompletableFuture<String> submitAsync(
      Prompt prompt, SamplingParams params, RequestOptions options) {
    Types.GenerationRequest request = request(prompt, params, options);
    Generation.AddRequestRequest message =
        Generation.AddRequestRequest.newBuilder().setRequest(request).build();
    CallTimeout timeout = CallTimeout.of(options.timeout(), defaultTimeout, "defaultTimeout");
    long deadline =
        timeout.duration() == null ? Long.MAX_VALUE : System.nanoTime() + timeout.leftNanos();
    CompletableFuture<String> result = new CompletableFuture<>();
    submitAttempt(options.headers(), message, timeout, deadline, 0, result);
    return result;
  }

  private void submitAttempt(
      Map<String, String> headers,
      Generation.AddRequestRequest message,
      CallTimeout timeout,
      long deadline,
      int attempt,
      CompletableFuture<String> result) {
    if (result.isDone()) {
      return;
    }
    CompletableFuture<Generation.AddRequestResponse> call =
        unaryAsync(
            timeout,
            stub -> Calls.unary(Calls.withHeaders(stub, headers)::addRequest, message, timeout));
    result.whenComplete(
        (value, error) -> {
          if (result.isCancelled()) {
            call.cancel(false);
          }
        });
    call.whenComplete(
        (response, error) -> {
          if (error == null) {
            result.complete(response.getRequestId());
            return;
          }
          CbserveException e = Calls.map(error, timeout);
          if (attempt > 0 && e instanceof AlreadyExistsException) {
            result.complete(message.getRequest().getRequestId());
            return;
          }
          long delay = Calls.backoffNanos(attempt);
          boolean timeLeft = deadline == Long.MAX_VALUE || deadline - System.nanoTime() > delay;
          if (!Calls.retryable(e) || attempt == Calls.SUBMIT_ATTEMPTS - 1 || !timeLeft) {
            result.completeExceptionally(e);
            return;
          }
          CompletableFuture.delayedExecutor(delay, TimeUnit.NANOSECONDS)
              .execute(
                  () -> submitAttempt(headers, message, timeout, deadline, attempt + 1, result));
        });
  }

  /**
   * Streams a request's outputs from the first token; see {@link #results(String, int,
   * RequestOptions)}.
   */
  public ChunkIterator results(String requestId) {
    return results(requestId, 0, RequestOptions.defaults());
  }

  /**
   * Streams a request's outputs from token {@code fromIndex}; see {@link #results(String, int,
   * RequestOptions)}.
   */
  public ChunkIterator results(String requestId, int fromIndex) {
    return results(requestId, fromIndex, RequestOptions.defaults());
  }

  /**
   * Streams a request's outputs from token {@code fromIndex} with this deadline (null: the
   * client's {@code streamTimeout}); see {@link #results(String, int, RequestOptions)}.
   */
  public ChunkIterator results(String requestId, int fromIndex, Duration timeout) {
    RequestOptions.Builder options = RequestOptions.builder();
    if (timeout != null) {
      options.timeout(timeout);
    }
    return results(requestId, fromIndex, options.build());
  }

  /**
   * Streams the outputs of a request ({@code StreamResults}) from token index {@code fromIndex}
   * on, until the request ends. To resume after a broken connection, pass the number of tokens
   * already received. Closing the iterator does not cancel the request. An unknown or expired id
   * throws {@link NotFoundException} from the iterator.
   *
   * @param options the call's deadline (else the client's {@code streamTimeout}) and headers; its
   *     request id, timestamps setting and priority do not apply (the request already has them)
   */
  public ChunkIterator results(String requestId, int fromIndex, RequestOptions options) {
    Objects.requireNonNull(requestId, "requestId");
    Objects.requireNonNull(options, "options");
    if (fromIndex < 0) {
      throw new IllegalArgumentException("fromIndex must be >= 0, got " + fromIndex);
    }
    Generation.StreamResultsRequest message =
        Generation.StreamResultsRequest.newBuilder()
            .setRequestId(requestId)
            .setFromTokenIndex(fromIndex)
            .build();
    CallTimeout timeout = CallTimeout.of(options.timeout(), streamTimeout, "streamTimeout");
    ChunkIterator chunks = new ChunkIterator(requestId, false, timeout);
    chunks.retryWith(
        null,
        (attempt, anyReplica) -> {
          GenerationServiceGrpc.GenerationServiceStub stub = stub(anyReplica);
          if (stub != null) {
            Calls.withTimeout(Calls.withHeaders(stub, options.headers()), timeout)
                .streamResults(
                    message,
                    chunks.<Generation.StreamResultsRequest, Generation.StreamResultsResponse>
                        observer(attempt, Generation.StreamResultsResponse::getChunk));
          }
          return stub != null;
        });
    ClientResponseObserver<Generation.StreamResultsRequest, Generation.StreamResultsResponse>
        observer = chunks.observer(Generation.StreamResultsResponse::getChunk);
    Calls.withTimeout(Calls.withHeaders(asyncStub, options.headers()), timeout)
        .streamResults(message, observer);
    return chunks;
  }

  /**
   * Cancels a request: it stops at the next engine step and frees its KV cache. Idempotent. With
   * {@link SamplingParams.Builder#n(int) n} &gt; 1 it cancels every sequence; {@link
   * #cancelSequence(String, int)} cancels one.
   *
   * @return true if the request was live, false if it had already ended (or was unknown)
   */
  public boolean cancel(String requestId) {
    Generation.CancelRequest message = cancelMessage(requestId);
    return blocking(unaryTimeout(), stub -> stub.cancel(message)).getCancelled();
  }

  /** {@link #cancel(String)} without blocking. */
  public CompletableFuture<Boolean> cancelAsync(String requestId) {
    Generation.CancelRequest message = cancelMessage(requestId);
    CallTimeout timeout = unaryTimeout();
    return unaryAsync(timeout, stub -> Calls.unary(stub::cancel, message, timeout))
        .thenApply(Generation.CancelResponse::getCancelled);
  }

  private static Generation.CancelRequest cancelMessage(String requestId) {
    return Generation.CancelRequest.newBuilder()
        .setRequestId(Objects.requireNonNull(requestId, "requestId"))
        .build();
  }

  /**
   * Cancels one sequence of a request of {@link SamplingParams.Builder#n(int) n} &gt; 1: it stops
   * at the next engine step, ends with {@link RequestStatus#CANCELLED} and {@link
   * FinishReason#CANCELLED}, and frees its own KV blocks, while the request's other sequences run
   * on. Idempotent. ({@link #cancel(String)} cancels all of them.)
   *
   * @param index the sequence, 0 to n - 1 ({@link Chunk#index()})
   * @return true if that sequence was live, false if it had already ended (or the request or
   *     sequence was unknown)
   * @throws IllegalArgumentException when {@code index} is negative or not below {@link
   *     SamplingBounds#MAX_N}
   */
  public boolean cancelSequence(String requestId, int index) {
    Generation.CancelRequest message = cancelMessage(requestId, index);
    return blocking(unaryTimeout(), stub -> stub.cancel(message)).getCancelled();
  }

  /** {@link #cancelSequence(String, int)} without blocking. */
  public CompletableFuture<Boolean> cancelSequenceAsync(String requestId, int index) {
    Generation.CancelRequest message = cancelMessage(requestId, index);
    CallTimeout timeout = unaryTimeout();
    return unaryAsync(timeout, stub -> Calls.unary(stub::cancel, message, timeout))
        .thenApply(Generation.CancelResponse::getCancelled);
  }

  /** The Cancel message of one sequence (package-private for the tests). */
  static Generation.CancelRequest cancelMessage(String requestId, int index) {
    if (index < 0 || index >= SamplingBounds.MAX_N) {
      throw new IllegalArgumentException(
          "index must be in [0, " + (SamplingBounds.MAX_N - 1) + "], got " + index);
    }
    return cancelMessage(requestId).toBuilder().setIndex(index).build();
  }

  /** Describes the served model. */
  public ModelInfo modelInfo() {
    Generation.GetModelInfoRequest message = Generation.GetModelInfoRequest.getDefaultInstance();
    return Convert.modelInfo(blocking(unaryTimeout(), stub -> stub.getModelInfo(message)));
  }

  /** {@link #modelInfo()} without blocking. */
  public CompletableFuture<ModelInfo> modelInfoAsync() {
    Generation.GetModelInfoRequest message = Generation.GetModelInfoRequest.getDefaultInstance();
    CallTimeout timeout = unaryTimeout();
    return unaryAsync(timeout, stub -> Calls.unary(stub::getModelInfo, message, timeout))
        .thenApply(Convert::modelInfo);
  }

  /**
   * The async stub of the client's channel, or with {@code anyReplica} of the channel without
   * health checking (made on first use; null when the builder was given a channel, or once the
   * client is closed).
   */
  private GenerationServiceGrpc.GenerationServiceStub stub(boolean anyReplica) {
    if (!anyReplica) {
      return asyncStub;
    }
    ManagedChannel any = anyReplicaChannel();
    return any == null ? null : GenerationServiceGrpc.newStub(any);
  }

  private synchronized ManagedChannel anyReplicaChannel() {
    if (anyReplicaOptions == null || closed) {
      return null;
    }
    if (anyReplicaChannel == null) {
      anyReplicaChannel = anyReplicaOptions.build();
    }
    return anyReplicaChannel;
  }

  /**
   * Makes a blocking unary call with this deadline on {@code call}'s stub (the deadline applied),
   * and again on a stub of any replica when no replica served it (see {@link #anyReplicaOptions}).
   */
  private <T> T blocking(
      CallTimeout timeout,
      Function<GenerationServiceGrpc.GenerationServiceBlockingStub, T> call) {
    try {
      return Calls.blocking(() -> call.apply(Calls.withTimeout(blockingStub, timeout)), timeout);
    } catch (UnavailableException e) {
      ManagedChannel any = Calls.noReplicaServing(e) ? anyReplicaChannel() : null;
      if (any == null) {
        throw e;
      }
      var stub = Calls.withTimeout(GenerationServiceGrpc.newBlockingStub(any), timeout);
      return Calls.blocking(() -> call.apply(stub), timeout);
    }
  }

  /**
   * Starts an async unary call with {@code call} on a stub with this deadline, and again on a stub
   * of any replica when no replica served it; cancelling the future cancels the call in flight.
   */
  private <T> CompletableFuture<T> unaryAsync(
      CallTimeout timeout,
      Function<GenerationServiceGrpc.GenerationServiceStub, CompletableFuture<T>> call) {
    CompletableFuture<T> result = new CompletableFuture<>();
    CompletableFuture<T> first = call.apply(Calls.withTimeout(asyncStub, timeout));
    result.whenComplete(
        (value, error) -> {
          if (result.isCancelled()) {
            first.cancel(false);
          }
        });
    first.whenComplete(
        (value, error) -> {
          if (error == null) {
            result.complete(value);
            return;
          }
          CbserveException mapped = Calls.map(error, timeout);
          GenerationServiceGrpc.GenerationServiceStub any =
              Calls.noReplicaServing(mapped) ? stub(true) : null;
          if (any == null || result.isDone()) {
            result.completeExceptionally(mapped);
            return;
          }
          CompletableFuture<T> second = call.apply(Calls.withTimeout(any, timeout));
          result.whenComplete(
              (value2, error2) -> {
                if (result.isCancelled()) {
                  second.cancel(false);
                }
              });
          second.whenComplete(
              (value2, error2) -> {
                if (error2 == null) {
                  result.complete(value2);
                } else {
                  result.completeExceptionally(Calls.map(error2, timeout));
                }
              });
        });
    return result;
  }

  /** The deadline of a unary call without RequestOptions: the client's default timeout. */
  private CallTimeout unaryTimeout() {
    return CallTimeout.client(defaultTimeout, "defaultTimeout");
  }

  // -- admin / lifecycle --------------------------------------------------------------------

  /**
   * The admin client of the same server, on {@link Builder#adminTarget(String)} with {@link
   * Builder#adminToken(String)} and this client's TLS settings and default timeout. Created on
   * first use and closed with this client.
   *
   * @throws IllegalStateException when the builder was given no admin target
   */
  public synchronized CbserveAdminClient admin() {
    if (closed) {
      throw new IllegalStateException("the client is closed");
    }
    if (adminOptions == null) {
      throw new IllegalStateException(
          "no admin target: set adminTarget(...) on the builder, or build a CbserveAdminClient");
    }
    if (admin == null) {
      admin = new CbserveAdminClient(adminOptions);
    }
    return admin;
  }

  /**
   * Closes the channel (unless it was given with {@link Builder#channel(ManagedChannel)}) and the
   * admin client; calls in flight are cancelled. Idempotent.
   */
  @Override
  public void close() {
    CbserveAdminClient adminClient;
    ManagedChannel any;
    synchronized (this) {
      if (closed) {
        return;
      }
      closed = true;
      adminClient = admin;
      any = anyReplicaChannel;
    }
    if (adminClient != null) {
      adminClient.close();
    }
    if (any != null) {
      ChannelShutdown.shutdown(any);
    }
    if (ownsChannel) {
      ChannelShutdown.shutdown(channel);
    }
  }

  /** The GenerationRequest message of a call (package-private for the tests). */
  static Types.GenerationRequest request(
      Prompt prompt, SamplingParams params, RequestOptions options) {
    Objects.requireNonNull(prompt, "prompt");
    Objects.requireNonNull(params, "params");
    Objects.requireNonNull(options, "options");
    Types.GenerationRequest.Builder request =
        Types.GenerationRequest.newBuilder()
            .setRequestId(
                options.requestId() != null ? options.requestId() : Calls.newRequestId())
            .setSampling(params.toProto())
            .setRecordTimestamps(options.recordTimestamps())
            .setPriority(options.priority());
    prompt.applyTo(request);
    return request.build();
  }

  /** Builds a {@link CbserveClient}. */
  public static final class Builder {
    private final ChannelOptions options = new ChannelOptions();
    private String adminTarget;
    private String adminToken;

    private Builder() {
      options.healthChecked = true;
    }

    /**
     * The server address, e.g. {@code "127.0.0.1:50051"}, or a name that resolves to several
     * servers, e.g. {@code "dns:///cbserve.default.svc.cluster.local:50051"} (a headless Kubernetes
     * Service): calls are spread over every address round-robin. Replaces {@link
     * #targets(String...)}.
     */
    public Builder target(String target) {
      options.target(target);
      return this;
    }

    /**
     * Several servers ({@code host:port} each, e.g. {@code "10.0.0.1:50051", "10.0.0.2:50051"}):
     * calls are spread over them round-robin, and a server that goes down is skipped until it
     * comes back. Hosts given by name are resolved when the channel connects and after a failure.
     * Replaces {@link #target(String)}.
     */
    public Builder targets(String... addresses) {
      return targets(Arrays.asList(Objects.requireNonNull(addresses, "addresses")));
    }

    /** Several servers; see {@link #targets(String...)}. */
    public Builder targets(List<String> addresses) {
      options.addresses(addresses);
      return this;
    }

    /**
     * HTTP/2 keepalive: after {@code time} without reads, ping the server, and close the
     * connection (failing its calls with {@link UnavailableException}) if no answer comes within
     * {@code timeout}. Only while calls are open. It finds a dead server or a dropped connection
     * behind a NAT or load balancer during a long stream; off unless set. The server allows a
     * ping every 5 min while it sends nothing (gRPC's default), so keep {@code time} at 5 min or
     * above unless the server is configured to accept more.
     */
    public Builder keepAlive(Duration time, Duration timeout) {
      options.keepAlive(time, timeout);
      return this;
    }

    /** A bearer token sent as {@code authorization: Bearer <token>} on every call. */
    public Builder token(String token) {
      options.token = token;
      return this;
    }

    /** TLS with the JVM's default trusted roots. */
    public Builder tls() {
      options.tls(null, null, null);
      return this;
    }

    /** TLS trusting the CA certificate(s) in this PEM file. */
    public Builder tls(Path caCertificate) {
      options.tls(Objects.requireNonNull(caCertificate, "caCertificate"), null, null);
      return this;
    }

    /**
     * Mutual TLS: trust {@code caCertificate} (null: the default roots) and present this client
     * certificate chain and PKCS#8 private key (PEM files).
     */
    public Builder tls(Path caCertificate, Path certificateChain, Path privateKey) {
      options.tls(
          caCertificate,
          Objects.requireNonNull(certificateChain, "certificateChain"),
          Objects.requireNonNull(privateKey, "privateKey"));
      return this;
    }

    /** Any channel credentials (e.g. {@code TlsChannelCredentials} built by hand). */
    public Builder credentials(ChannelCredentials credentials) {
      options.credentials(credentials);
      return this;
    }

    /** The authority (TLS server name) to use instead of the target's host. */
    public Builder authority(String authority) {
      options.authority = Objects.requireNonNull(authority, "authority");
      return this;
    }

    /** Deadline of unary calls (default 60 s); null for none. */
    public Builder defaultTimeout(Duration timeout) {
      options.defaultTimeout(timeout);
      return this;
    }

    /**
     * Deadline of streaming calls ({@code generate}, {@code generateAsync}, {@code generateN},
     * {@code generateNAsync}, {@code stream}, {@code results}; default 10 min); null for none.
     * {@link RequestOptions#timeout()} overrides it for one call.
     */
    public Builder streamTimeout(Duration timeout) {
      options.streamTimeout(timeout);
      return this;
    }

    /**
     * Uses this channel instead of building one (target, token, TLS, keepalive, load balancing
     * and retry settings are then the channel's own); the client does not close it.
     */
    public Builder channel(ManagedChannel channel) {
      options.channel = Objects.requireNonNull(channel, "channel");
      return this;
    }

    /** The admin address for {@link CbserveClient#admin()}, e.g. {@code "127.0.0.1:50052"}. */
    public Builder adminTarget(String adminTarget) {
      this.adminTarget = Objects.requireNonNull(adminTarget, "adminTarget");
      return this;
    }

    /** The admin bearer token for {@link CbserveClient#admin()}. */
    public Builder adminToken(String adminToken) {
      this.adminToken = adminToken;
      return this;
    }

    /** The client. */
    public CbserveClient build() {
      return new CbserveClient(this);
    }
  }
}
