package dev.cbserve.client;

import io.grpc.Status;

/** {@code UNAUTHENTICATED}: missing or wrong bearer token (admin calls). */
public class UnauthenticatedException extends CbserveException {
  private static final long serialVersionUID = 1L;

  /** An exception with these details. */
  public UnauthenticatedException(String details) {
    this(details, null);
  }

  /** An exception with these details and cause. */
  public UnauthenticatedException(String details, Throwable cause) {
    super(Status.Code.UNAUTHENTICATED, details, cause);
  }
}
