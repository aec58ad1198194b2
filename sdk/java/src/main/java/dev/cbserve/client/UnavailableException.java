package dev.cbserve.client;

import io.grpc.Status;

/**
 * {@code UNAVAILABLE}: the server is unreachable, loading, stopping or stopped; nothing was queued.
 */
public class UnavailableException extends CbserveException {
  private static final long serialVersionUID = 1L;

  /** An exception with these details. */
  public UnavailableException(String details) {
    this(details, null);
  }

  /** An exception with these details and cause. */
  public UnavailableException(String details, Throwable cause) {
    super(Status.Code.UNAVAILABLE, details, cause);
  }
}
