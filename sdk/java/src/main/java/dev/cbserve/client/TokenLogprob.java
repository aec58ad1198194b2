package dev.cbserve.client;

import java.util.List;
import java.util.Objects;
import java.util.Optional;

/**
 * Log-probability of one generated token (of the distribution {@link LogprobsMode} names), with the
 * most likely alternatives when {@code topLogprobs} was asked for.
 *
 * @param tokenId the generated token
 * @param logprob its log-probability
 * @param top the most likely alternatives, most likely first (empty unless asked for)
 * @param logKeptMass with {@link SamplingParams.Builder#returnKeptMass(boolean)}: the natural log
 *     of the probability mass top-k, top-p and min-p kept of the distribution they truncated
 *     (after logit bias, penalties and temperature), 0 when they removed nothing; a {@link
 *     LogprobsMode#PROCESSED} logprob plus it is the token's logprob before truncation. Empty when
 *     not asked for.
 */
public record TokenLogprob(
    int tokenId, float logprob, List<TopLogprob> top, Optional<Float> logKeptMass) {
  /** Copies {@code top} into an immutable list. */
  public TokenLogprob {
    top = List.copyOf(top);
    Objects.requireNonNull(logKeptMass, "logKeptMass");
  }

  /** A token's log-probability without a kept mass. */
  public TokenLogprob(int tokenId, float logprob, List<TopLogprob> top) {
    this(tokenId, logprob, top, Optional.empty());
  }
}
