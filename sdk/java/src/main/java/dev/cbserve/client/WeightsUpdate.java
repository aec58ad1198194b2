package dev.cbserve.client;

/**
 * What {@link CbserveAdminClient#updateWeights(java.util.List, String)} (or {@code
 * updateWeightsFromPath}) did.
 *
 * @param weightVersion the version of the weights now served: the previous version + 1
 * @param tensorsUpdated the number of tensors replaced
 * @param versionLabel the label sent with the update, empty when none was
 */
public record WeightsUpdate(long weightVersion, int tensorsUpdated, String versionLabel) {}
