package dev.cbserve.client;

import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.HexFormat;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.TreeMap;
import java.util.TreeSet;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CompletionException;
import java.util.stream.Collectors;
import net.openhft.hashing.LongTupleHashFunction;

/**
 * The weights' checksum on the client's side: the digest a server computes of the weights it
 * holds ({@link CbserveAdminClient#weightsChecksum(boolean)}), computed here of {@link Tensor}s,
 * and the comparison of every replica's in one call ({@link #check(WeightsChecksum, List)}).
 *
 * <p>The algorithm, {@value #ALGORITHM}, depends on a tensor's bytes, shape and dtype alone, so
 * equal tensors give equal digests on any device: a tensor's digest is {@code "xxh3-128:"} and the
 * lowercase hex (canonical, big-endian) of XXH3-128, seed 0, of {@code
 * "{dtype}:{shape, comma-separated}:{bytes}:"} followed by the tensor's bytes (C order,
 * little-endian); the model's is the same of the lines {@code "{name}\t{digest}\n"} in name order.
 * The algorithm's name starts every digest, so a digest of another algorithm never compares equal
 * by accident. The server and the Python SDK define it in {@code cbserve_checksum}; the three SDKs
 * check the same vectors ({@code tests/data/weights_checksum_vectors.json}).
 */
public final class WeightsChecksums {
  /** The algorithm's name, as servers report it. */
  public static final String ALGORITHM = "xxh3-128";

  private static final LongTupleHashFunction XXH3_128 = LongTupleHashFunction.xx128();

  private WeightsChecksums() {}

  /** The digest of one tensor, as a server computes it of a tensor of the same dtype, shape and bytes. */
  public static String tensorDigest(Tensor tensor) {
    byte[] data = tensor.data();
    String shape = tensor.shape().stream().map(String::valueOf).collect(Collectors.joining(","));
    byte[] header =
        (tensor.dtype() + ":" + shape + ":" + data.length + ":").getBytes(StandardCharsets.US_ASCII);
    // The hash takes one buffer: the header and the bytes, side by side.
    ByteBuffer input =
        ByteBuffer.allocate(header.length + data.length).put(header).put(data).flip();
    return prefixedDigest(XXH3_128.hashBytes(input));
  }

  /**
   * The digest of each tensor and of them all, as a server holding exactly these tensors reports
   * it with per-tensor digests: a trainer's check of what it pushed. Give every tensor of the
   * model's state dict, in the dtype the server holds it in, to compare the whole-model digest.
   *
   * @throws IllegalArgumentException when a name is given twice
   */
  public static WeightsChecksum of(List<Tensor> tensors) {
    Map<String, TensorChecksum> digests = new TreeMap<>();
    for (Tensor tensor : tensors) {
      TensorChecksum checksum =
          new TensorChecksum(tensor.name(), tensorDigest(tensor), tensor.dtype(), tensor.shape());
      if (digests.put(tensor.name(), checksum) != null) {
        throw new IllegalArgumentException("tensor '" + tensor.name() + "' is given twice");
      }
    }
    return new WeightsChecksum(combinedDigest(digests), ALGORITHM, 0, digests.size(), digests);
  }

  /**
   * Checks in one call that every replica holds the same weights (slime's check_weights after a
   * sync): each computes its checksum with per-tensor digests, in parallel, and each is compared
   * with {@code expected} (a trainer's own, from {@link #of(List)}), or when it is null with the
   * first replica's.
   *
   * @param expected the weights every replica should hold, or null to compare them with the first
   * @param replicas the replicas' admin clients, at least one
   * @return the common checksum
   * @throws WeightsMismatchException naming every replica that differs and the tensors it differs in
   * @throws CbserveException when a replica cannot answer (the first such failure)
   */
  public static WeightsChecksum check(WeightsChecksum expected, List<CbserveAdminClient> replicas) {
    if (replicas.isEmpty()) {
      throw new IllegalArgumentException("check needs at least one replica");
    }
    List<CompletableFuture<WeightsChecksum>> calls = new ArrayList<>();
    for (CbserveAdminClient replica : replicas) {
      calls.add(CompletableFuture.supplyAsync(() -> replica.weightsChecksum(true)));
    }
    Map<String, WeightsChecksum> checksums = new LinkedHashMap<>();
    for (int i = 0; i < replicas.size(); i++) {
      try {
        checksums.put(replicas.get(i).target(), calls.get(i).join());
      } catch (CompletionException e) {
        if (e.getCause() instanceof RuntimeException cause) {
          throw cause;
        }
        throw e;
      }
    }
    String referenceName = "expected";
    WeightsChecksum reference = expected;
    if (reference == null) {
      referenceName = replicas.get(0).target();
      reference = checksums.get(referenceName);
    }
    Map<String, List<String>> differing = new TreeMap<>();
    for (Map.Entry<String, WeightsChecksum> entry : checksums.entrySet()) {
      WeightsChecksum checksum = entry.getValue();
      if (!checksum.algorithm().equals(reference.algorithm())
          || !checksum.digest().equals(reference.digest())) {
        differing.put(entry.getKey(), differingTensors(reference, checksum));
      }
    }
    if (!differing.isEmpty()) {
      throw new WeightsMismatchException(referenceName, checksums, differing);
    }
    return reference;
  }

  private static List<String> differingTensors(WeightsChecksum reference, WeightsChecksum checksum) {
    TreeSet<String> names = new TreeSet<>(reference.tensors().keySet());
    names.addAll(checksum.tensors().keySet());
    boolean sameAlgorithm = reference.algorithm().equals(checksum.algorithm());
    List<String> differing = new ArrayList<>();
    for (String name : names) {
      TensorChecksum ours = reference.tensors().get(name);
      TensorChecksum theirs = checksum.tensors().get(name);
      if (!sameAlgorithm
          || ours == null
          || theirs == null
          || !Objects.equals(ours.digest(), theirs.digest())) {
        differing.add(name);
      }
    }
    return differing;
  }

  static String combinedDigest(Map<String, TensorChecksum> tensors) {
    StringBuilder lines = new StringBuilder();
    for (TensorChecksum tensor : new TreeMap<>(tensors).values()) {
      lines.append(tensor.name()).append('\t').append(tensor.digest()).append('\n');
    }
    return prefixedDigest(XXH3_128.hashBytes(lines.toString().getBytes(StandardCharsets.UTF_8)));
  }

  /** {@code "xxh3-128:"} and the hash in XXH3's canonical form: the high 64 bits first. */
  private static String prefixedDigest(long[] lowThenHigh) {
    HexFormat hex = HexFormat.of();
    return ALGORITHM + ":" + hex.toHexDigits(lowThenHigh[1]) + hex.toHexDigits(lowThenHigh[0]);
  }
}
