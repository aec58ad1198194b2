package dev.cbserve.client;

import java.util.List;

/**
 * Log-probability of one generated token (log_softmax of the raw logits), with the most likely
 * alternatives when {@code topLogprobs} was asked for.
 *
 * @param tokenId the generated token
 * @param logprob its log-probability
 * @param top the most likely alternatives, most likely first (empty unless asked for)
 */
public record TokenLogprob(int tokenId, float logprob, List<TopLogprob> top) {
  /** Copies {@code top} into an immutable list. */
  public TokenLogprob {
    top = List.copyOf(top);
  }
}
