package dev.cbserve.client;

import io.grpc.Status;
import io.grpc.StatusException;
import io.grpc.StatusRuntimeException;
import io.grpc.stub.AbstractStub;
import io.grpc.stub.ClientCallStreamObserver;
import io.grpc.stub.ClientResponseObserver;
import io.grpc.stub.StreamObserver;
import java.time.Duration;
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

/** Helpers shared by the clients: deadlines, error mapping, retries, async unary calls. */
final class Calls {
  /** Default deadline of unary calls. */
  static final Duration DEFAULT_TIMEOUT = Duration.ofSeconds(60);

  /** Tries of a submit (AddRequest), retried on UNAVAILABLE and RESOURCE_EXHAUSTED only. */
  static final int SUBMIT_ATTEMPTS = 3;

  private static final long RETRY_BASE_DELAY_NANOS = TimeUnit.MILLISECONDS.toNanos(100);

  /**
   * Failures of an add on a Generate stream that AddRequest would have reported as a status code:
   * the SDK throws them, as it does for AddRequest, instead of returning a failed completion.
   */
  private static final Set<Integer> REJECTION_CODES =
      Set.of(
          Status.Code.INVALID_ARGUMENT.value(),
          Status.Code.ALREADY_EXISTS.value(),
          Status.Code.RESOURCE_EXHAUSTED.value(),
          Status.Code.UNAVAILABLE.value(),
          Status.Code.NOT_FOUND.value());

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

  static <S extends AbstractStub<S>> S withTimeoutNanos(S stub, long nanos) {
    return stub.withDeadlineAfter(Math.max(0, nanos), TimeUnit.NANOSECONDS);
  }

  /** The exception to throw for a failed chunk that reports a rejected request, else null. */
  static CbserveException rejection(Chunk chunk) {
    if (chunk.status() == RequestStatus.FAILED && REJECTION_CODES.contains(chunk.errorCode())) {
      return CbserveException.ofNumber(chunk.errorCode(), chunk.error());
    }
    return null;
  }

  /** Maps any failure of a call to the matching {@link CbserveException}. */
  static CbserveException map(Throwable error) {
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
      String details = status.getDescription();
      if (details == null && status.getCause() != null) {
        details = status.getCause().toString();
      }
      return CbserveException.of(status.getCode(), details, t);
    }
    if (t instanceof CancellationException) {
      return new CancelledException("cancelled by the caller", t);
    }
    return new InternalException(Status.Code.UNKNOWN, String.valueOf(t), t);
  }

  /** Runs a blocking call, mapping gRPC's exceptions. */
  static <T> T blocking(Supplier<T> call) {
    try {
      return call.get();
    } catch (StatusRuntimeException e) {
      throw map(e);
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
            future.completeExceptionally(map(t));
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
