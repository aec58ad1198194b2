package dev.cbserve.client;

import io.grpc.Status;

/** {@code NOT_FOUND}: an unknown (or expired) request id. */
public class NotFoundException extends CbserveException {
  private static final long serialVersionUID = 1L;

  /** An exception with these details. */
  public NotFoundException(String details) {
    this(details, null);
  }

  /** An exception with these details and cause. */
  public NotFoundException(String details, Throwable cause) {
    super(Status.Code.NOT_FOUND, details, cause);
  }
}
