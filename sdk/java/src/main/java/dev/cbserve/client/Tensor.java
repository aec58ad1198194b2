package dev.cbserve.client;

import java.util.Arrays;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.TreeSet;

/**
 * One named tensor of {@link CbserveAdminClient#updateWeights(List, String)}: its elements as raw
 * bytes, in C order and little-endian, as safetensors stores them.
 *
 * <pre>{@code
 * ByteBuffer ones = ByteBuffer.allocate(4 * 64).order(ByteOrder.LITTLE_ENDIAN);
 * while (ones.hasRemaining()) {
 *   ones.putFloat(1f);
 * }
 * Tensor norm = Tensor.of("model.norm.weight", "F32", ones.array(), 64);
 * }</pre>
 *
 * @param name the parameter's name in the model's state dict, e.g. {@code
 *     "model.layers.0.mlp.up_proj.weight"}
 * @param dtype the element type as safetensors names it: {@code "F64"}, {@code "F32"}, {@code
 *     "F16"}, {@code "BF16"}, {@code "F8_E4M3"}, {@code "F8_E5M2"}, {@code "I64"}, {@code "I32"},
 *     {@code "I16"}, {@code "I8"}, {@code "U64"}, {@code "U32"}, {@code "U16"}, {@code "U8"} or
 *     {@code "BOOL"}. It need not be the parameter's: the server converts floating-point types to
 *     one another, and integer types.
 * @param shape the tensor's shape; it must equal the parameter's
 * @param data the elements: the product of {@code shape} times the size of {@code dtype} bytes. Not
 *     copied: leave it unchanged until the update returns.
 */
public record Tensor(String name, String dtype, List<Long> shape, byte[] data) {
  /** Bytes per element of each safetensors dtype the server accepts. */
  private static final Map<String, Integer> DTYPE_SIZES =
      Map.ofEntries(
          Map.entry("F64", 8),
          Map.entry("F32", 4),
          Map.entry("F16", 2),
          Map.entry("BF16", 2),
          Map.entry("F8_E4M3", 1),
          Map.entry("F8_E5M2", 1),
          Map.entry("I64", 8),
          Map.entry("I32", 4),
          Map.entry("I16", 2),
          Map.entry("I8", 1),
          Map.entry("U64", 8),
          Map.entry("U32", 4),
          Map.entry("U16", 2),
          Map.entry("U8", 1),
          Map.entry("BOOL", 1));

  /**
   * Checks the tensor: a name, a known dtype, no negative dimension, and {@code data} of the size
   * {@code shape} and {@code dtype} imply.
   *
   * @throws IllegalArgumentException naming the tensor and what is wrong with it
   */
  public Tensor {
    Objects.requireNonNull(name, "name");
    Objects.requireNonNull(dtype, "dtype");
    Objects.requireNonNull(data, "data");
    shape = List.copyOf(shape);
    if (name.isEmpty()) {
      throw new IllegalArgumentException("a tensor has no name");
    }
    Integer itemSize = DTYPE_SIZES.get(dtype);
    if (itemSize == null) {
      throw new IllegalArgumentException(
          "tensor '" + name + "': unknown dtype '" + dtype + "'; expected one of "
              + new TreeSet<>(DTYPE_SIZES.keySet()));
    }
    long size = itemSize;
    for (long dim : shape) {
      if (dim < 0) {
        throw new IllegalArgumentException(
            "tensor '" + name + "': negative dimension in shape " + shape);
      }
      if (dim > 0 && size > Long.MAX_VALUE / dim) {
        throw new IllegalArgumentException(
            "tensor '" + name + "': shape " + shape + " is too large");
      }
      size *= dim;
    }
    if (data.length != size) {
      throw new IllegalArgumentException(
          "tensor '" + name + "' of dtype " + dtype + " and shape " + shape + " needs " + size
              + " bytes, data has " + data.length);
    }
  }

  /** A tensor of the given shape, e.g. {@code Tensor.of("model.norm.weight", "F32", bytes, 64)}. */
  public static Tensor of(String name, String dtype, byte[] data, long... shape) {
    return new Tensor(name, dtype, Arrays.stream(shape).boxed().toList(), data);
  }

  /** Equal name, dtype, shape and bytes. */
  @Override
  public boolean equals(Object other) {
    return other instanceof Tensor t
        && name.equals(t.name)
        && dtype.equals(t.dtype)
        && shape.equals(t.shape)
        && Arrays.equals(data, t.data);
  }

  @Override
  public int hashCode() {
    return Objects.hash(name, dtype, shape, Arrays.hashCode(data));
  }

  /** The name, dtype, shape and byte count (not the bytes). */
  @Override
  public String toString() {
    return "Tensor[" + name + ", " + dtype + ", shape " + shape + ", " + data.length + " bytes]";
  }
}
