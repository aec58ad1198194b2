package dev.cbserve.client;

import io.grpc.Status;
import java.util.Objects;

/**
 * A failed cbserve call: the gRPC status code and the server's (or gRPC's) description.
 *
 * <p>Every call of {@link CbserveClient}, {@link CbserveAdminClient}, {@link ChunkIterator} and
 * {@link PauseLease} throws this (unchecked) exception or one of its subclasses instead of gRPC's
 * own exceptions; the original one is kept as the cause. Every status code has its subclass, as
 * every Python SDK exception and Go sentinel error has its code ({@code INTERNAL}, {@code UNKNOWN}
 * and {@code DATA_LOSS} share {@link InternalException}: a caller handles them alike). Use {@link
 * #of(Status.Code, String)} to build the right subclass for a code.
 */
public class CbserveException extends RuntimeException {
  private static final long serialVersionUID = 1L;

  private final Status.Code code;
  private final String details;

  /** An exception with the given code and details. */
  public CbserveException(Status.Code code, String details) {
    this(code, details, null);
  }

  /** An exception with the given code, details and cause. */
  public CbserveException(Status.Code code, String details, Throwable cause) {
    super(message(code, details), cause);
    this.code = Objects.requireNonNull(code, "code");
    this.details = details == null ? "" : details;
  }

  /** The gRPC status code of the failure. */
  public Status.Code code() {
    return code;
  }

  /** The description of the failure (may be empty). */
  public String details() {
    return details;
  }

  /** The exception class that matches {@code code}, with these details. */
  public static CbserveException of(Status.Code code, String details) {
    return of(code, details, null);
  }

  /** The exception class that matches {@code code}, with these details and cause. */
  public static CbserveException of(Status.Code code, String details, Throwable cause) {
    switch (code) {
      case INVALID_ARGUMENT:
        return new InvalidArgumentException(details, cause);
      case NOT_FOUND:
        return new NotFoundException(details, cause);
      case ALREADY_EXISTS:
        return new AlreadyExistsException(details, cause);
      case RESOURCE_EXHAUSTED:
        return new ResourceExhaustedException(details, cause);
      case UNAVAILABLE:
        return new UnavailableException(details, cause);
      case UNAUTHENTICATED:
        return new UnauthenticatedException(details, cause);
      case CANCELLED:
        return new CancelledException(details, cause);
      case DEADLINE_EXCEEDED:
        return new DeadlineExceededException(details, cause);
      case FAILED_PRECONDITION:
        return new FailedPreconditionException(details, cause);
      case PERMISSION_DENIED:
        return new PermissionDeniedException(details, cause);
      case UNIMPLEMENTED:
        return new UnimplementedException(details, cause);
      case ABORTED:
        return new AbortedException(details, cause);
      case OUT_OF_RANGE:
        return new OutOfRangeException(details, cause);
      case INTERNAL:
      case UNKNOWN:
      case DATA_LOSS:
        return new InternalException(code, details, cause);
      default:
        return new CbserveException(code, details, cause);
    }
  }

  /**
   * The exception for a {@code google.rpc.Code} number (the wire's {@code error_code}); unknown
   * numbers map to {@code UNKNOWN}.
   */
  public static CbserveException ofNumber(int code, String details) {
    Status.Code mapped = Status.Code.UNKNOWN;
    for (Status.Code candidate : Status.Code.values()) {
      if (candidate.value() == code) {
        mapped = candidate;
        break;
      }
    }
    return of(mapped, details);
  }

  private static String message(Status.Code code, String details) {
    return details == null || details.isEmpty() ? String.valueOf(code) : code + ": " + details;
  }
}
