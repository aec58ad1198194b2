package dev.cbserve.client;

import java.util.List;

/**
 * The digest of one tensor ({@link WeightsChecksum#tensors()}).
 *
 * @param name the tensor's name in the model's state dict
 * @param digest lowercase hex digest of its bytes, shape and dtype
 * @param dtype the dtype it is held in, as safetensors names it ({@code "F32"}, {@code "BF16"}, ...)
 * @param shape its (whole) shape
 */
public record TensorChecksum(String name, String digest, String dtype, List<Long> shape) {
  /** Copies {@code shape}. */
  public TensorChecksum {
    shape = List.copyOf(shape);
  }
}
