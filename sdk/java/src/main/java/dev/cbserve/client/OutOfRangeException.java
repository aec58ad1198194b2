package dev.cbserve.client;

import io.grpc.Status;

/** {@code OUT_OF_RANGE}: a value past the end of what the server holds. */
public class OutOfRangeException extends CbserveException {
  private static final long serialVersionUID = 1L;

  /** An exception with these details. */
  public OutOfRangeException(String details) {
    this(details, null);
  }

  /** An exception with these details and cause. */
  public OutOfRangeException(String details, Throwable cause) {
    super(Status.Code.OUT_OF_RANGE, details, cause);
  }
}
