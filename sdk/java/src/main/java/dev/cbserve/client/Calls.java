package dev.cbserve.client;

import io.grpc.Metadata;
import io.grpc.Status;
import io.grpc.StatusException;
import io.grpc.StatusRuntimeException;
import io.grpc.stub.AbstractStub;
import io.grpc.stub.MetadataUtils;
import io.grpc.stub.ClientCallStreamObserver;
import io.grpc.stub.ClientResponseObserver;
import io.grpc.stub.StreamObserver;
import java.nio.channels.ClosedChannelException;
import java.time.Duration;
import java.util.Map;
import java.util.Set;
import java.util.UUID;
import java.util.concurrent.CancellationException;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CompletionException;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.ThreadLocalRandom;
import java.util.concurrent.TimeUnit;
import java.util.function.BiConsumer;
import java.util.function.Supplier;
import java.util.regex.Pattern;

/** Helpers shared by the clients: deadlines, error mapping, retries, async unary calls. */
final class Calls {
  /** Default deadline of unary calls. */
  static final Duration DEFAULT_TIMEOUT = Duration.ofSeconds(60);

  /**
   * Default deadline of streaming calls (generate, stream, results): long enough for any
   * generation a healthy server runs, short enough that a stalled server does not hang a caller
   * for ever.
   */
  static final Duration DEFAULT_STREAM_TIMEOUT = Duration.ofMinutes(10);

  /** Tries of a submit (AddRequest), retried on UNAVAILABLE and RESOURCE_EXHAUSTED only. */
  static final int SUBMIT_ATTEMPTS = 3;

  private static final long RETRY_BASE_DELAY_NANOS = TimeUnit.MILLISECONDS.toNanos(100);

  /**
   * Failures of an add on a Generate stream that AddRequest would have reported as a status code:
   * the SDK throws them, as it does for AddRequest, instead of returning a failed completion.
   */
  private static final Set<Status.Code> REJECTION_CODES =
      Set.of(
          Status.Code.INVALID_ARGUMENT,
          Status.Code.ALREADY_EXISTS,
          Status.Code.RESOURCE_EXHAUSTED,
          Status.Code.UNAVAILABLE,
          Status.Code.NOT_FOUND);

  private Calls() {}

  static Duration checkTimeout(Duration timeout) {
    if (timeout.isNegative() || timeout.isZero()) {
      throw new IllegalArgumentException("timeout must be positive, got " + timeout);
    }
    return timeout;
  }

  /** A fresh client-side request id (32 hex digits). */
  static String newRequestId() {
    return UUID.randomUUID().toString().replace("-", "");
  }

  /** {@code stub} with a deadline {@code timeout} from now, or unchanged when it is null. */
  static <S extends AbstractStub<S>> S withTimeout(S stub, Duration timeout) {
    return timeout == null ? stub : withTimeoutNanos(stub, timeout.toNanos());
  }

  /** {@code stub} with the deadline of the call, what is left of it, or unchanged with none. */
  static <S extends AbstractStub<S>> S withTimeout(S stub, CallTimeout timeout) {
    return timeout.duration() == null ? stub : withTimeoutNanos(stub, timeout.leftNanos());
  }

  /** {@code stub} sending these extra headers (unchanged when there are none). */
  static <S extends AbstractStub<S>> S withHeaders(S stub, Map<String, String> headers) {
    if (headers.isEmpty()) {
      return stub;
    }
    Metadata metadata = new Metadata();
    headers.forEach(
        (name, value) -> metadata.put(Metadata.Key.of(name, Metadata.ASCII_STRING_MARSHALLER), value));
    return stub.withInterceptors(MetadataUtils.newAttachHeadersInterceptor(metadata));
  }

  static <S extends AbstractStub<S>> S withTimeoutNanos(S stub, long nanos) {
    return stub.withDeadlineAfter(Math.max(0, nanos), TimeUnit.NANOSECONDS);
  }

  /** The exception to throw for a failed chunk that reports a rejected request, else null. */
  static CbserveException rejection(Chunk chunk) {
    if (chunk.status() == RequestStatus.FAILED && REJECTION_CODES.contains(chunk.errorCode())) {
      return CbserveException.of(chunk.errorCode(), chunk.error());
    }
    return null;
  }

  /**
   * grpc-java's own descriptions of a deadline that passed on the client ("deadline exceeded after
   * 0.2s. [buffered_nanos=...]", "Deadline CallOptions was exceeded after 0.026s waiting for
   * name_resolver", "ClientCall started after CallOptions deadline was exceeded", ...).
   */
  private static final Pattern CLIENT_DEADLINE =
      Pattern.compile("(?i)(deadline|context timed out)");

  /** What a call that found no replica serving (and could not ask one why) says. */
  static final String NOT_SERVING =
      "no replica is serving: each one connected reports NOT_SERVING on grpc.health.v1 (its model"
          + " loading, a drain or stop under way, asleep, or its weights incomplete)";

  /** Whether a call failed because no replica was serving, rather than on a replica. */
  static boolean noReplicaServing(CbserveException error) {
    return error instanceof UnavailableException && NOT_SERVING.equals(error.details());
  }

  /** Maps any failure of a call to the matching {@link CbserveException}. */
  static CbserveException map(Throwable error) {
    return map(error, null);
  }

  /**
   * Maps any failure of a call to the matching {@link CbserveException}. {@code timeout} is the
   * call's deadline (or null when unknown): when it has passed, the exception says which deadline
   * it was and what sets it (grpc-java's own message lists its transport internals, buffered nanos
   * or the resolver it was waiting for, which tell a caller nothing to act on). An unreachable
   * server names the cause (connection refused, unknown host) rather than only grpc-java's "io
   * exception".
   */
  static CbserveException map(Throwable error, CallTimeout timeout) {
    Throwable t = error;
    while ((t instanceof CompletionException || t instanceof ExecutionException)
        && t.getCause() != null) {
      t = t.getCause();
    }
    if (t instanceof CbserveException) {
      return (CbserveException) t;
    }
    if (t instanceof StatusRuntimeException || t instanceof StatusException) {
      Status status = Status.fromThrowable(t);
      String description = status.getDescription();
      if (status.getCode() == Status.Code.UNAVAILABLE
          && description != null
          && description.contains("responded NOT_SERVING")) {
        // Every connection is up, but health checking takes each out of rotation; grpc-java's own
        // message names only the health service.
        return new UnavailableException(NOT_SERVING, t);
      }
      if (status.getCode() == Status.Code.UNKNOWN && closedConnection(status.getCause())) {
        // grpc-java reports a connection that closed under a call (the server died or restarted)
        // as UNKNOWN; for the caller it is the server becoming unavailable, and as safe to retry.
        return new UnavailableException("the connection to the server closed during the call", t);
      }
      return CbserveException.of(status.getCode(), details(status, timeout), t);
    }
    if (t instanceof CancellationException) {
      return new CancelledException("cancelled by the caller", t);
    }
    return new InternalException(Status.Code.UNKNOWN, String.valueOf(t), t);
  }

  private static boolean closedConnection(Throwable cause) {
    for (Throwable t = cause; t != null; t = t.getCause()) {
      if (t instanceof ClosedChannelException) {
        return true;
      }
    }
    return false;
  }

  private static String details(Status status, CallTimeout timeout) {
    String description = status.getDescription();
    if (status.getCode() == Status.Code.DEADLINE_EXCEEDED
        && (description == null
            || CLIENT_DEADLINE.matcher(description).find()
            || (timeout != null && timeout.passed()))) {
      return timeout == null || timeout.duration() == null
          ? "the call's deadline passed"
          : timeout.explanation();
    }
    String cause = rootCauseMessage(status.getCause());
    if (cause == null) {
      return description;
    }
    return description == null ? cause : description + ": " + cause;
  }

  /**
   * How Netty's native transport prefixes a socket error with the system call and errno
   * ("finishConnect(..) failed with error(-111): Connection refused: /host:port").
   */
  private static final Pattern NATIVE_CALL =
      Pattern.compile("^\\w+\\(\\.\\.\\) failed with error\\(-?\\d+\\): ");

  /**
   * The first message along the cause chain (e.g. "Connection refused: /host:port"), without the
   * system call Netty's native transport names.
   */
  private static String rootCauseMessage(Throwable cause) {
    for (Throwable t = cause; t != null; t = t.getCause() == t ? null : t.getCause()) {
      if (t.getMessage() != null && !t.getMessage().isEmpty()) {
        return NATIVE_CALL.matcher(t.getMessage()).replaceFirst("");
      }
    }
    return null;
  }

  /** A duration the way a person writes it: 200 ms, 1.5 s, 10 min. */
  static String describe(Duration d) {
    if (d.compareTo(Duration.ofSeconds(1)) < 0) {
      return d.toMillis() + " ms";
    }
    if (d.toSecondsPart() == 0 && d.toMillisPart() == 0 && d.toMinutes() > 0) {
      return d.toMinutes() + " min";
    }
    return d.toMillisPart() == 0 ? d.toSeconds() + " s" : d.toMillis() / 1000.0 + " s";
  }

  /** Runs a blocking call, mapping gRPC's exceptions. */
  static <T> T blocking(Supplier<T> call) {
    return blocking(call, null);
  }

  /** Runs a blocking call with this deadline (or null), mapping gRPC's exceptions. */
  static <T> T blocking(Supplier<T> call, CallTimeout timeout) {
    try {
      return call.get();
    } catch (StatusRuntimeException e) {
      throw map(e, timeout);
    }
  }

  /** Delay before retry number {@code attempt} (0-based): exponential, with +-50% jitter. */
  static long backoffNanos(int attempt) {
    double jitter = 0.5 + ThreadLocalRandom.current().nextDouble();
    return (long) (RETRY_BASE_DELAY_NANOS * Math.pow(2, attempt) * jitter);
  }

  static boolean retryable(CbserveException e) {
    return e instanceof UnavailableException || e instanceof ResourceExhaustedException;
  }

  /**
   * Starts an async unary call; the future completes with its response, or exceptionally with the
   * mapped {@link CbserveException}. Cancelling the future cancels the call.
   */
  static <ReqT, RespT> CompletableFuture<RespT> unary(
      BiConsumer<ReqT, StreamObserver<RespT>> method, ReqT request) {
    return unary(method, request, null);
  }

  /** {@link #unary(BiConsumer, Object)} of a call with this deadline (or null). */
  static <ReqT, RespT> CompletableFuture<RespT> unary(
      BiConsumer<ReqT, StreamObserver<RespT>> method, ReqT request, CallTimeout timeout) {
    CompletableFuture<RespT> future = new CompletableFuture<>();
    method.accept(
        request,
        new ClientResponseObserver<ReqT, RespT>() {
          @Override
          public void beforeStart(ClientCallStreamObserver<ReqT> call) {
            future.whenComplete(
                (value, error) -> {
                  if (future.isCancelled()) {
                    call.cancel("cancelled by the caller", null);
                  }
                });
          }

          @Override
          public void onNext(RespT value) {
            future.complete(value);
          }

          @Override
          public void onError(Throwable t) {
            future.completeExceptionally(map(t, timeout));
          }

          @Override
          public void onCompleted() {
            if (!future.isDone()) {
              future.completeExceptionally(
                  new InternalException(Status.Code.INTERNAL, "no response", null));
            }
          }
        });
    return future;
  }
}
