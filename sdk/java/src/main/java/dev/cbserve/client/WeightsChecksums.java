package dev.cbserve.client;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
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

/**
 * The weights' checksum on the client's side: the digest a server computes of the weights it
 * holds ({@link CbserveAdminClient#weightsChecksum(boolean)}), computed here of {@link Tensor}s,
 * and the comparison of every replica's in one call ({@link #check(WeightsChecksum, List)}).
 *
 * <p>The algorithm, {@value #ALGORITHM}, depends on a tensor's bytes, shape and dtype alone, so
 * equal tensors give equal digests on any device. A tensor's bytes (C order, little-endian,
 * zero-padded to a multiple of 4) are read as 32-bit words w<sub>i</sub>; with q<sub>i</sub> = i *
 * 0x9E3779B1 + 0x243F6A88 and h<sub>i</sub> = fmix32(w<sub>i</sub> XOR q<sub>i</sub>) (mod
 * 2<sup>32</sup>, i taken mod 2<sup>32</sup>; fmix32 is MurmurHash3's finaliser), two lanes sum
 * int32(h<sub>i</sub>) and int32(h<sub>i</sub> * (q<sub>i</sub> OR 1)), mod 2<sup>64</sup>; the
 * tensor's digest is the hex SHA-256 of {@code "{dtype}:{shape, comma-separated}:{bytes}:"}
 * followed by the two lanes as 8-byte little-endian integers; the model's is the hex SHA-256 of the
 * lines {@code "{name}\t{digest}\n"} in name order.
 */
public final class WeightsChecksums {
  /** The algorithm's name, as servers report it. */
  public static final String ALGORITHM = "cbserve-wsum-v1";

  private static final int POSITION_MULTIPLIER = 0x9E3779B1;
  private static final int POSITION_OFFSET = 0x243F6A88;

  private WeightsChecksums() {}

  /** The digest of one tensor, as a server computes it of a tensor of the same dtype, shape and bytes. */
  public static String tensorDigest(Tensor tensor) {
    byte[] data = tensor.data();
    long[] lanes = new long[2];
    ByteBuffer words = ByteBuffer.wrap(data).order(ByteOrder.LITTLE_ENDIAN);
    byte[] tail = new byte[4];
    for (int start = 0; start < data.length; start += 4) {
      int word;
      if (start + 4 <= data.length) {
        word = words.getInt(start);
      } else {
        java.util.Arrays.fill(tail, (byte) 0);
        System.arraycopy(data, start, tail, 0, data.length - start);
        word = ByteBuffer.wrap(tail).order(ByteOrder.LITTLE_ENDIAN).getInt();
      }
      int q = (start >>> 2) * POSITION_MULTIPLIER + POSITION_OFFSET; // the word's index, mod 2^32
      int h = fmix32(word ^ q);
      lanes[0] += h;
      lanes[1] += h * (q | 1);
    }
    String shape = tensor.shape().stream().map(String::valueOf).collect(Collectors.joining(","));
    MessageDigest sha256 = sha256();
    sha256.update(
        (tensor.dtype() + ":" + shape + ":" + data.length + ":").getBytes(StandardCharsets.US_ASCII));
    ByteBuffer laneBytes = ByteBuffer.allocate(16).order(ByteOrder.LITTLE_ENDIAN);
    laneBytes.putLong(lanes[0]).putLong(lanes[1]);
    sha256.update(laneBytes.array());
    return HexFormat.of().formatHex(sha256.digest());
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
    MessageDigest sha256 = sha256();
    for (TensorChecksum tensor : new TreeMap<>(tensors).values()) {
      sha256.update((tensor.name() + "\t" + tensor.digest() + "\n").getBytes(StandardCharsets.UTF_8));
    }
    return HexFormat.of().formatHex(sha256.digest());
  }

  /** MurmurHash3's 32-bit finaliser. */
  private static int fmix32(int h) {
    h ^= h >>> 16;
    h *= 0x85EBCA6B;
    h ^= h >>> 13;
    h *= 0xC2B2AE35;
    h ^= h >>> 16;
    return h;
  }

  private static MessageDigest sha256() {
    try {
      return MessageDigest.getInstance("SHA-256");
    } catch (NoSuchAlgorithmException e) {
      throw new IllegalStateException("every Java platform has SHA-256", e);
    }
  }
}
