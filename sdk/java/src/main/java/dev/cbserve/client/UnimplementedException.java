package dev.cbserve.client;

import io.grpc.Status;

/**
 * {@code UNIMPLEMENTED}: the server does not implement the call (an older server, a proxy that does
 * not route it, or an admin call sent to the generation port).
 */
public class UnimplementedException extends CbserveException {
  private static final long serialVersionUID = 1L;

  /** An exception with these details. */
  public UnimplementedException(String details) {
    this(details, null);
  }

  /** An exception with these details and cause. */
  public UnimplementedException(String details, Throwable cause) {
    super(Status.Code.UNIMPLEMENTED, details, cause);
  }
}
