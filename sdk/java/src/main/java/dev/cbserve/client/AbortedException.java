package dev.cbserve.client;

import io.grpc.Status;

/**
 * {@code ABORTED}: the server gave up the call midway (a weight transfer from a trainer that
 * failed); the details say what it changed.
 */
public class AbortedException extends CbserveException {
  private static final long serialVersionUID = 1L;

  /** An exception with these details. */
  public AbortedException(String details) {
    this(details, null);
  }

  /** An exception with these details and cause. */
  public AbortedException(String details, Throwable cause) {
    super(Status.Code.ABORTED, details, cause);
  }
}
