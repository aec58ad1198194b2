package dev.cbserve.client;

import io.grpc.Status;

/** {@code INTERNAL}, {@code UNKNOWN} or {@code DATA_LOSS}: a server-side (or protocol) failure. */
public class InternalException extends CbserveException {
  private static final long serialVersionUID = 1L;

  /** An {@code INTERNAL} exception with these details. */
  public InternalException(String details) {
    this(Status.Code.INTERNAL, details, null);
  }

  /** An exception with one of the codes INTERNAL, UNKNOWN or DATA_LOSS. */
  public InternalException(Status.Code code, String details, Throwable cause) {
    super(code, details, cause);
  }
}
