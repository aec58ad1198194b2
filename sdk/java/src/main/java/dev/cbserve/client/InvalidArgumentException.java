package dev.cbserve.client;

import io.grpc.Status;

/**
 * {@code INVALID_ARGUMENT}: a malformed request (empty prompt, token id outside the vocabulary,
 * out-of-range sampling parameter, ...); the details name the field.
 */
public class InvalidArgumentException extends CbserveException {
  private static final long serialVersionUID = 1L;

  /** An exception with these details. */
  public InvalidArgumentException(String details) {
    this(details, null);
  }

  /** An exception with these details and cause. */
  public InvalidArgumentException(String details, Throwable cause) {
    super(Status.Code.INVALID_ARGUMENT, details, cause);
  }
}
