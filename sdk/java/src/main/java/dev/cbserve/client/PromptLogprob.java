package dev.cbserve.client;

import java.util.List;

/**
 * Log-probability of one prompt token given the prompt tokens before it, with its position's most
 * likely alternatives ({@link SamplingParams.Builder#promptLogprobs(int)}).
 *
 * @param tokenId the prompt token
 * @param logprob its log-probability given the tokens before it
 * @param topLogprobs the {@code promptLogprobs} most likely tokens at its position, most likely
 *     first (empty when {@code promptLogprobs} was 0)
 */
public record PromptLogprob(int tokenId, float logprob, List<TopLogprob> topLogprobs) {
  /** Copies {@code topLogprobs} into an immutable list. */
  public PromptLogprob {
    topLogprobs = List.copyOf(topLogprobs);
  }
}
