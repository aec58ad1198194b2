package dev.cbserve.client;

/**
 * What {@link CbserveAdminClient#resetPrefixCache(boolean)} did.
 *
 * @param droppedBlocks reusable prefix blocks forgotten
 * @param abortedRequests requests cancelled first (with abort)
 */
public record PrefixCacheReset(int droppedBlocks, int abortedRequests) {}
