package dev.cbserve.client;

import io.grpc.Status;

/** {@code ALREADY_EXISTS}: the request id is already used by a live request. */
public class AlreadyExistsException extends CbserveException {
  private static final long serialVersionUID = 1L;

  /** An exception with these details. */
  public AlreadyExistsException(String details) {
    this(details, null);
  }

  /** An exception with these details and cause. */
  public AlreadyExistsException(String details, Throwable cause) {
    super(Status.Code.ALREADY_EXISTS, details, cause);
  }
}
