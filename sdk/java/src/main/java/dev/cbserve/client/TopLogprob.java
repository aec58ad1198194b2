package dev.cbserve.client;

/**
 * One of the most likely alternatives at a generation step.
 *
 * @param tokenId the alternative token
 * @param logprob its log-probability
 */
public record TopLogprob(int tokenId, float logprob) {}
