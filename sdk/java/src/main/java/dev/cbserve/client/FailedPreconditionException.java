package dev.cbserve.client;

import io.grpc.Status;

/**
 * {@code FAILED_PRECONDITION}: the server's state does not allow the call now (a prefix-cache reset
 * with requests in flight, an update over a weight-update group the server is not in, ...); the
 * details say what to do.
 */
public class FailedPreconditionException extends CbserveException {
  private static final long serialVersionUID = 1L;

  /** An exception with these details. */
  public FailedPreconditionException(String details) {
    this(details, null);
  }

  /** An exception with these details and cause. */
  public FailedPreconditionException(String details, Throwable cause) {
    super(Status.Code.FAILED_PRECONDITION, details, cause);
  }
}
