package dev.cbserve.client;

import java.util.Map;

/**
 * The engine's state now and its counters since the server started ({@link
 * CbserveAdminClient#status()}).
 *
 * @param running started and not stopped
 * @param paused paused by at least one pause lease (or a weight update)
 * @param pauseHolders open pause leases
 * @param queuedRequests requests waiting to be scheduled
 * @param activeRequests requests prefilling or decoding
 * @param kvBlocksUsed KV cache blocks in use (held by requests, or cached and not evictable)
 * @param kvBlocksTotal KV cache blocks in all
 * @param prefixCacheHitRate prefix cache hits / queries, in [0, 1]
 * @param weightVersion version of the weights now served
 * @param preemptions running requests preempted to free KV blocks
 * @param offloads KV blocks copied to the CPU offload pool
 * @param restores KV blocks copied back from it
 * @param recomputedTokens tokens computed again after a preemption
 * @param prefixCacheQueries prefix cache lookups
 * @param prefixCacheHits prefix cache lookups that found a block
 * @param finishedRequests requests that reached a terminal status
 * @param promptTokens prompt tokens of all requests accepted
 * @param generatedTokens tokens generated
 * @param counters further server-defined counters, by name
 */
public record EngineStatus(
    boolean running,
    boolean paused,
    int pauseHolders,
    int queuedRequests,
    int activeRequests,
    int kvBlocksUsed,
    int kvBlocksTotal,
    double prefixCacheHitRate,
    long weightVersion,
    long preemptions,
    long offloads,
    long restores,
    long recomputedTokens,
    long prefixCacheQueries,
    long prefixCacheHits,
    long finishedRequests,
    long promptTokens,
    long generatedTokens,
    Map<String, Double> counters) {

  /** Copies {@code counters} into an immutable map. */
  public EngineStatus {
    counters = Map.copyOf(counters);
  }
}
