package dev.cbserve.client;

import io.grpc.Status;

/**
 * {@code PERMISSION_DENIED}: the credentials are valid but not allowed this call (a proxy's or a
 * mesh's authorization policy, say).
 */
public class PermissionDeniedException extends CbserveException {
  private static final long serialVersionUID = 1L;

  /** An exception with these details. */
  public PermissionDeniedException(String details) {
    this(details, null);
  }

  /** An exception with these details and cause. */
  public PermissionDeniedException(String details, Throwable cause) {
    super(Status.Code.PERMISSION_DENIED, details, cause);
  }
}
