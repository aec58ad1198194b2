package dev.cbserve.client;

import io.grpc.Metadata;
import java.time.Duration;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.Objects;

/**
 * Per-call options of {@code generate}, {@code stream}, {@code submit} and {@code results}: the
 * request id, token timestamps, the scheduling priority, the call's deadline and extra headers
 * (gRPC metadata).
 * Immutable; build with {@link #builder()}.
 */
public final class RequestOptions {
  private static final RequestOptions DEFAULTS = new Builder().build();

  private final String requestId;
  private final boolean recordTimestamps;
  private final int priority;
  private final Duration timeout;
  private final Map<String, String> headers;

  private RequestOptions(Builder b) {
    this.requestId = b.requestId;
    this.recordTimestamps = b.recordTimestamps;
    this.priority = b.priority;
    this.timeout = b.timeout;
    this.headers = Collections.unmodifiableMap(new LinkedHashMap<>(b.headers));
  }

  /**
   * No request id (one is generated client-side), no timestamps, priority 0, the default deadline.
   */
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

  /** The request's scheduling priority (0 unless set); smaller values go first. */
  public int priority() {
    return priority;
  }

  /**
   * The call's deadline, or null for the client's default: its {@code streamTimeout} for
   * streaming calls ({@code generate}, {@code stream}, {@code results}), its {@code
   * defaultTimeout} for {@code submit}.
   */
  public Duration timeout() {
    return timeout;
  }

  /** Extra headers sent with the call, in the order given (empty unless set). */
  public Map<String, String> headers() {
    return headers;
  }

  /** Builds {@link RequestOptions}. */
  public static final class Builder {
    private String requestId;
    private boolean recordTimestamps;
    private int priority;
    private Duration timeout;
    private final Map<String, String> headers = new LinkedHashMap<>();

    private Builder() {}

    /**
     * The request's id: unique among the server's live requests, at most 128 bytes of printable
     * ASCII ({@link SamplingBounds#MAX_REQUEST_ID_BYTES}). Unset: the client generates a random one (so that a retried submit never queues the
     * request twice).
     */
    public Builder requestId(String requestId) {
      Objects.requireNonNull(requestId, "requestId");
      if (requestId.isEmpty()) {
        // The server would pick one, which this client could not follow.
        throw new IllegalArgumentException(
            "request_id must not be empty: leave it unset for a random one");
      }
      if (requestId.length() > SamplingBounds.MAX_REQUEST_ID_BYTES
          || !requestId.chars().allMatch(c -> c > ' ' && c <= '~')) {
        throw new IllegalArgumentException(
            "request_id must be at most " + SamplingBounds.MAX_REQUEST_ID_BYTES
                + " bytes of printable ASCII, got \"" + requestId + "\"");
      }
      this.requestId = requestId;
      return this;
    }

    /** Returns every token's server wall-clock time in {@link Chunk#tokenTimestamps()}. */
    public Builder recordTimestamps(boolean recordTimestamps) {
      this.recordTimestamps = recordTimestamps;
      return this;
    }

    /**
     * The request's scheduling priority when the server runs the {@code priority} scheduler
     * ({@code --scheduler-type priority}): smaller values are admitted first (ties first-come), and
     * when memory runs out the running request with the largest value is preempted first. Other
     * schedulers ignore it. In [{@link SamplingBounds#MIN_PRIORITY}, {@link
     * SamplingBounds#MAX_PRIORITY}] (an int32 on the wire); 0 unless set. Does not apply to {@code
     * results} (the request already has one).
     */
    public Builder priority(long priority) {
      this.priority =
          ServerWording.checkInt(
              "priority",
              priority,
              SamplingBounds.MIN_PRIORITY,
              (long) SamplingBounds.MAX_PRIORITY,
              "");
      return this;
    }

    /** The call's deadline (must be positive). */
    public Builder timeout(Duration timeout) {
      this.timeout = Calls.checkTimeout(Objects.requireNonNull(timeout, "timeout"));
      return this;
    }

    /**
     * Sends this header (gRPC metadata) with the call, e.g. a tenant or trace id for a proxy in
     * front of the servers; a second value for the same name replaces the first. Names are
     * lower-case ASCII (letters, digits, {@code - _ .}) not ending in {@code -bin}; values
     * printable ASCII.
     */
    public Builder header(String name, String value) {
      Objects.requireNonNull(name, "name");
      Objects.requireNonNull(value, "value");
      if (name.isEmpty()
          || name.endsWith(Metadata.BINARY_HEADER_SUFFIX)
          || !name.chars().allMatch(c -> (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9')
              || c == '-' || c == '_' || c == '.')) {
        throw new IllegalArgumentException(
            "header name must be lower-case letters, digits, '-', '_' or '.', not ending in -bin;"
                + " got \"" + name + "\"");
      }
      if (!value.chars().allMatch(c -> c >= ' ' && c <= '~')) {
        throw new IllegalArgumentException(
            "header " + name + ": the value must be printable ASCII");
      }
      headers.put(name, value);
      return this;
    }

    /** The options. */
    public RequestOptions build() {
      return new RequestOptions(this);
    }
  }
}
