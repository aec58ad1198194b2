package dev.cbserve.client;

import io.grpc.stub.ClientCallStreamObserver;
import java.time.Instant;

/**
 * A hold on the engine's pause ({@link CbserveAdminClient#pause()}): the engine stays paused while
 * this lease is open. {@link #close()} ends the Pause call, which releases the hold (the engine
 * resumes when its last holder lets go). The server also drops the hold when its lease expires or
 * the connection breaks, so a crashed client cannot freeze it.
 *
 * <pre>{@code
 * try (PauseLease lease = admin.pause()) {
 *   // the engine is paused here
 * }
 * }</pre>
 */
public final class PauseLease implements AutoCloseable {
  private final ClientCallStreamObserver<?> call;
  private final int holders;
  private final Instant leaseExpiresAt;
  private final long weightVersion;
  private final int cancelledRequests;
  private volatile boolean released;

  PauseLease(
      ClientCallStreamObserver<?> call,
      int holders,
      Instant leaseExpiresAt,
      long weightVersion,
      int cancelledRequests) {
    this.call = call;
    this.holders = holders;
    this.leaseExpiresAt = leaseExpiresAt;
    this.weightVersion = weightVersion;
    this.cancelledRequests = cancelledRequests;
  }

  /** Open Pause calls holding the engine when it paused, this one included. */
  public int holders() {
    return holders;
  }

  /** When the server drops this hold unless it is closed first (null if the server sent none). */
  public Instant leaseExpiresAt() {
    return leaseExpiresAt;
  }

  /** Version of the weights served when the engine paused. */
  public long weightVersion() {
    return weightVersion;
  }

  /** With {@link PauseMode#ABORT}: the number of requests the pause cancelled. */
  public int cancelledRequests() {
    return cancelledRequests;
  }

  /**
   * True while this lease holds the engine paused: false once closed, or once the server ended
   * the hold (lease expired, connection lost).
   */
  public boolean isHeld() {
    return !released;
  }

  /** Marks the hold as ended by the server. */
  void released() {
    released = true;
  }

  /** Releases the hold (cancels the Pause call). Idempotent. */
  @Override
  public void close() {
    released = true;
    call.cancel("pause released by the client", null);
  }

  @Override
  public String toString() {
    return "PauseLease{holders=" + holders + ", leaseExpiresAt=" + leaseExpiresAt
        + ", held=" + isHeld() + "}";
  }
}
