package dev.cbserve.client;

import java.time.Duration;

/**
 * The deadline of one call (all its tries): how long it has from its start, what set it, and what
 * the caller changes for a longer one. A {@link DeadlineExceededException} of the call says so in
 * place of grpc-java's wording, which names where grpc-java was waiting ("waiting for
 * name_resolver", buffered nanos, the remote address) and not which deadline passed.
 *
 * @param duration how long the call has, or null for no deadline
 * @param setBy what set it, e.g. "the client's streamTimeout"
 * @param remedy what gives a longer one
 * @param startNanos when the call started ({@link System#nanoTime()})
 */
record CallTimeout(Duration duration, String setBy, String remedy, long startNanos) {

  /** The deadline of a generation client's call: {@code perCall}, else the client's own. */
  static CallTimeout of(Duration perCall, Duration client, String clientSetter) {
    String remedy =
        "pass RequestOptions.timeout(...) to the call, or "
            + clientSetter
            + "(...) to the client's builder, for a longer one (null: none)";
    return perCall != null
        ? new CallTimeout(perCall, "RequestOptions.timeout", remedy, System.nanoTime())
        : new CallTimeout(client, "the client's " + clientSetter, remedy, System.nanoTime());
  }

  /** The deadline of a generation client's call that takes no RequestOptions: the client's. */
  static CallTimeout client(Duration client, String clientSetter) {
    return new CallTimeout(
        client,
        "the client's " + clientSetter,
        "pass " + clientSetter + "(...) to the client's builder for a longer one (null: none)",
        System.nanoTime());
  }

  /** The deadline of an admin client's call, its default timeout. */
  static CallTimeout admin(Duration duration) {
    return new CallTimeout(
        duration,
        "the admin client's defaultTimeout",
        "pass defaultTimeout(...) to its builder for a longer one (null: none)",
        System.nanoTime());
  }

  /** The deadline of a call that has no default, {@code duration} given by the caller. */
  static CallTimeout given(Duration duration, String setBy) {
    return new CallTimeout(
        duration, setBy, "pass a longer one (null: none)", System.nanoTime());
  }

  /** Nanoseconds left before the deadline (never negative), or Long.MAX_VALUE with none. */
  long leftNanos() {
    return duration == null
        ? Long.MAX_VALUE
        : Math.max(0, duration.toNanos() - (System.nanoTime() - startNanos));
  }

  /** Whether the deadline has passed (false with none). */
  boolean passed() {
    return duration != null && leftNanos() == 0;
  }

  /** What a passed deadline says: which one, how long, and what changes it. */
  String explanation() {
    return "the call's deadline of "
        + Calls.describe(duration)
        + " ("
        + setBy
        + ") passed; "
        + remedy;
  }
}
