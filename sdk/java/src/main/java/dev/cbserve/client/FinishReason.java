package dev.cbserve.client;

/** Why a request ended. */
public enum FinishReason {
  /** An EOS token was generated (it is included in the output). */
  EOS,
  /** maxNewTokens were generated, or the model's context is full. */
  LENGTH,
  /** The request was cancelled. */
  CANCELLED,
  /** The request failed ({@link Completion#error()} says why). */
  ERROR,
  /**
   * The output text contained one of the {@link SamplingParams.Builder#stop(String...) stop
   * strings}: the text ends just before it, while the token ids include the token that completed
   * it.
   */
  STOP
}
