package dev.cbserve.client;

import cbserve.v1.Types;

/**
 * Which distribution a generated token's logprobs are of ({@link SamplingParams.Builder#logprobsMode},
 * vLLM's {@code logprobs_mode}).
 */
public enum LogprobsMode {
  /** The server's default: its {@code --logprobs-mode}, raw unless set. */
  SERVER_DEFAULT(Types.LogprobsMode.LOGPROBS_MODE_UNSPECIFIED),
  /** log_softmax of the model's logits, before anything touches them (vLLM's raw_logprobs). */
  RAW(Types.LogprobsMode.LOGPROBS_MODE_RAW),
  /**
   * Of the distribution each token was drawn from (vLLM's processed_logprobs): after logit bias,
   * penalties and structured-output masks, then, when the request samples (temperature above 0),
   * temperature, top-k, top-p and min-p. What an importance ratio between a trainer and this
   * sampler needs. Tokens the filters removed are left out of the top logprobs.
   */
  PROCESSED(Types.LogprobsMode.LOGPROBS_MODE_PROCESSED);

  final Types.LogprobsMode wire;

  LogprobsMode(Types.LogprobsMode wire) {
    this.wire = wire;
  }
}
