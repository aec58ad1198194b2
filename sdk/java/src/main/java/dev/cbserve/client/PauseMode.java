package dev.cbserve.client;

/** How {@link CbserveAdminClient#pause(PauseMode)} pauses the engine. */
public enum PauseMode {
  /** Stop stepping at once; in-flight requests keep their KV cache and go on after the resume. */
  KEEP,
  /** Schedule no new request, let the in-flight ones finish, then pause. */
  WAIT,
  /** Cancel every in-flight and queued request, then pause. */
  ABORT
}
