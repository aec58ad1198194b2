package dev.cbserve.client;

import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;

/**
 * {@link WeightsChecksums#check(WeightsChecksum, List)} found replicas whose weights differ from
 * the reference: the expected checksum, or else the first replica's.
 */
public final class WeightsMismatchException extends RuntimeException {
  private static final long serialVersionUID = 1L;
  private static final int SHOWN = 5;

  /** {@code "expected"}, or the target of the replica the others were compared with. */
  private final String reference;

  /** Each replica's checksum, by target. */
  private final transient Map<String, WeightsChecksum> checksums;

  /** For each replica that differs, the tensors whose digests differ, in name order. */
  private final transient Map<String, List<String>> differing;

  WeightsMismatchException(
      String reference,
      Map<String, WeightsChecksum> checksums,
      Map<String, List<String>> differing) {
    super(message(reference, checksums, differing));
    this.reference = reference;
    this.checksums = Map.copyOf(checksums);
    this.differing = new TreeMap<>(differing);
  }

  /** {@code "expected"}, or the target of the replica the others were compared with. */
  public String reference() {
    return reference;
  }

  /** Each replica's checksum, by target. */
  public Map<String, WeightsChecksum> checksums() {
    return checksums;
  }

  /**
   * For each replica that differs, the names of the tensors whose digests differ from the
   * reference's (a name held by one side only included), in name order.
   */
  public Map<String, List<String>> differing() {
    return differing;
  }

  private static String message(
      String reference,
      Map<String, WeightsChecksum> checksums,
      Map<String, List<String>> differing) {
    List<String> parts = new ArrayList<>();
    for (Map.Entry<String, List<String>> entry : new TreeMap<>(differing).entrySet()) {
      List<String> names = entry.getValue();
      String listed = String.join(", ", names.subList(0, Math.min(SHOWN, names.size())));
      if (names.size() > SHOWN) {
        listed += " and " + (names.size() - SHOWN) + " more";
      }
      parts.add(
          entry.getKey() + " (weight_version " + checksums.get(entry.getKey()).weightVersion()
              + ") in " + names.size() + " tensors: " + listed);
    }
    String against = reference.equals("expected") ? "the expected weights" : reference;
    return differing.size() + " of " + checksums.size() + " replicas hold other weights than "
        + against + ": " + String.join("; ", parts);
  }
}
