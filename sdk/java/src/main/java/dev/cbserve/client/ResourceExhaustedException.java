package dev.cbserve.client;

import io.grpc.Status;

/**
 * {@code RESOURCE_EXHAUSTED}: the server's request queue is full; nothing was queued, so retrying
 * later is safe.
 */
public class ResourceExhaustedException extends CbserveException {
  private static final long serialVersionUID = 1L;

  /** An exception with these details. */
  public ResourceExhaustedException(String details) {
    this(details, null);
  }

  /** An exception with these details and cause. */
  public ResourceExhaustedException(String details, Throwable cause) {
    super(Status.Code.RESOURCE_EXHAUSTED, details, cause);
  }
}
