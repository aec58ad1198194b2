package dev.cbserve.client;

import java.util.Map;
import java.util.TreeMap;

/**
 * A digest of a model's weights ({@link CbserveAdminClient#weightsChecksum(boolean)}, {@link
 * WeightsChecksums#of(java.util.List)}).
 *
 * @param digest lowercase hex digest of every tensor together
 * @param algorithm how it is computed ({@link WeightsChecksums#ALGORITHM})
 * @param weightVersion the server's version of the weights it is of (0 from {@link
 *     WeightsChecksums#of(java.util.List)})
 * @param numTensors number of tensors the digest covers
 * @param tensors each tensor's digest by name, in name order, when asked for; empty otherwise
 */
public record WeightsChecksum(
    String digest,
    String algorithm,
    long weightVersion,
    int numTensors,
    Map<String, TensorChecksum> tensors) {
  /** Copies {@code tensors}, in name order. */
  public WeightsChecksum {
    tensors = java.util.Collections.unmodifiableSortedMap(new TreeMap<>(tensors));
  }
}
