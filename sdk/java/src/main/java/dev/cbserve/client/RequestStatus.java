package dev.cbserve.client;

/**
 * The lifecycle state of a request: {@code QUEUED -> PREFILLING -> DECODING}, ending in exactly
 * one of {@code FINISHED}, {@code CANCELLED} or {@code FAILED}.
 */
public enum RequestStatus {
  /** Not set (never sent by a conforming server). */
  UNSPECIFIED,
  /** Accepted and waiting to be scheduled. */
  QUEUED,
  /** Its prompt is being processed. */
  PREFILLING,
  /** Generating tokens. */
  DECODING,
  /** Finished normally (EOS, stop string or length). Terminal. */
  FINISHED,
  /** Cancelled. Terminal. */
  CANCELLED,
  /** Failed ({@link Chunk#error()} says why). Terminal. */
  FAILED;

  /** True for FINISHED, CANCELLED and FAILED. */
  public boolean isTerminal() {
    return this == FINISHED || this == CANCELLED || this == FAILED;
  }
}
