package dev.cbserve.client;

import java.time.Duration;
import java.util.Objects;

/**
 * Per-call options of {@code generate}, {@code stream} and {@code submit}: the request id, token
 * timestamps, and the call's deadline. Immutable; build with {@link #builder()}.
 */
public final class RequestOptions {
  private static final RequestOptions DEFAULTS = new Builder().build();

  private final String requestId;
  private final boolean recordTimestamps;
  private final Duration timeout;

  private RequestOptions(Builder b) {
    this.requestId = b.requestId;
    this.recordTimestamps = b.recordTimestamps;
    this.timeout = b.timeout;
  }

  /** No request id (one is generated client-side), no timestamps, the default deadline. */
  public static RequestOptions defaults() {
    return DEFAULTS;
  }

  /** A new builder. */
  public static Builder builder() {
    return new Builder();
  }

  /** The caller-chosen request id, or null to generate one. */
  public String requestId() {
    return requestId;
  }

  /** Whether each token's server wall-clock time is returned. */
  public boolean recordTimestamps() {
    return recordTimestamps;
  }

  /**
   * The call's deadline, or null for the default: none for streaming calls ({@code generate},
   * {@code stream}), the client's default timeout for {@code submit}.
   */
  public Duration timeout() {
    return timeout;
  }

  /** Builds {@link RequestOptions}. */
  public static final class Builder {
    private String requestId;
    private boolean recordTimestamps;
    private Duration timeout;

    private Builder() {}

    /**
     * The request's id: unique among the server's live requests, at most 128 bytes of printable
     * ASCII. Unset: the client generates a random one (so that a retried submit never queues the
     * request twice).
     */
    public Builder requestId(String requestId) {
      this.requestId = Objects.requireNonNull(requestId, "requestId");
      return this;
    }

    /** Returns every token's server wall-clock time in {@link Chunk#tokenTimestamps()}. */
    public Builder recordTimestamps(boolean recordTimestamps) {
      this.recordTimestamps = recordTimestamps;
      return this;
    }

    /** The call's deadline (must be positive). */
    public Builder timeout(Duration timeout) {
      this.timeout = Calls.checkTimeout(Objects.requireNonNull(timeout, "timeout"));
      return this;
    }

    /** The options. */
    public RequestOptions build() {
      return new RequestOptions(this);
    }
  }
}
