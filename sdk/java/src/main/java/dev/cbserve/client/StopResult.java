package dev.cbserve.client;

/**
 * What {@link CbserveAdminClient#stop(boolean)} did.
 *
 * @param drainedRequests requests that finished normally while draining
 * @param failedRequests requests failed or cancelled by the stop
 * @param alreadyStopped true when the engine was already stopped (nothing was done)
 */
public record StopResult(int drainedRequests, int failedRequests, boolean alreadyStopped) {}
