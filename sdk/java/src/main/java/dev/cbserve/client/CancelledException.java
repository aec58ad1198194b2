package dev.cbserve.client;

import io.grpc.Status;

/**
 * {@code CANCELLED}: the call was cancelled (by this client, e.g. a closed stream or an interrupted
 * thread, or by the server).
 */
public class CancelledException extends CbserveException {
  private static final long serialVersionUID = 1L;

  /** An exception with these details. */
  public CancelledException(String details) {
    this(details, null);
  }

  /** An exception with these details and cause. */
  public CancelledException(String details, Throwable cause) {
    super(Status.Code.CANCELLED, details, cause);
  }
}
