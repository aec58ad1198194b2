package dev.cbserve.client;

import io.grpc.Status;

/** {@code DEADLINE_EXCEEDED}: the call's deadline passed before it completed. */
public class DeadlineExceededException extends CbserveException {
  private static final long serialVersionUID = 1L;

  /** An exception with these details. */
  public DeadlineExceededException(String details) {
    this(details, null);
  }

  /** An exception with these details and cause. */
  public DeadlineExceededException(String details, Throwable cause) {
    super(Status.Code.DEADLINE_EXCEEDED, details, cause);
  }
}
