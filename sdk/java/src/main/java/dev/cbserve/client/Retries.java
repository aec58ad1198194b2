package dev.cbserve.client;

import java.util.concurrent.TimeUnit;

/**
 * The tries one generation call may make (a Generate call made again after it failed with {@code
 * UNAVAILABLE} where nothing ran), all within the call's deadline. Shared by the iterator that
 * retries before its first chunk and by {@code generate}, which also retries a broken stream, so
 * that the two together make at most {@link #MAX_ATTEMPTS} tries. Thread-safe.
 */
final class Retries {
  /** Tries of a generation call, the first included (as the unary calls' retry policy). */
  static final int MAX_ATTEMPTS = ChannelOptions.RETRY_ATTEMPTS;

  private final CallTimeout timeout;
  private int attempts = 1;

  Retries(CallTimeout timeout) {
    this.timeout = timeout;
  }

  /**
   * Counts the next try and returns the backoff to wait before it (exponential from 100 ms, with
   * jitter), or -1 when no try is left or the deadline would pass during the wait.
   */
  synchronized long nextDelayNanos() {
    if (attempts >= MAX_ATTEMPTS) {
      return -1;
    }
    long delay = Calls.backoffNanos(attempts - 1);
    if (delay >= timeout.leftNanos()) {
      return -1;
    }
    attempts++;
    return delay;
  }

  /**
   * Waits for the next try: false when none is left (see {@link #nextDelayNanos()}).
   *
   * @throws CancelledException when the thread is interrupted while waiting (the flag is kept)
   */
  boolean awaitNext() {
    long delay = nextDelayNanos();
    if (delay < 0) {
      return false;
    }
    try {
      TimeUnit.NANOSECONDS.sleep(delay);
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
      throw new CancelledException("interrupted while waiting to retry", e);
    }
    return true;
  }
}
