package dev.cbserve.client;

import cbserve.v1.Admin;
import com.google.protobuf.ByteString;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.util.HexFormat;
import java.util.Iterator;
import java.util.List;
import java.util.NoSuchElementException;

/**
 * The UpdateWeights client stream of a list of tensors: the version label first if there is one,
 * then each tensor's chunks in order, consecutive slices of its data of at most {@code chunkSize}
 * bytes (an empty tensor is one chunk without data), every chunk carrying the tensor's name, dtype,
 * shape, byte offset and the SHA-256 of all of its bytes. Messages are built as the call asks for
 * them, so no second copy of a whole tensor is made.
 */
final class UpdateWeightsRequests implements Iterator<Admin.UpdateWeightsRequest> {
  /**
   * The most tensor bytes in one message: the bound the protocol sets for clients, well under
   * gRPC's default 4 MiB message limit.
   */
  static final int MAX_CHUNK_BYTES = 1 << 20;

  private String versionLabel;
  private final Iterator<Tensor> tensors;
  private final int chunkSize;
  private Tensor current;
  private String sha256;
  private int offset;

  UpdateWeightsRequests(String versionLabel, List<Tensor> tensors, int chunkSize) {
    if (chunkSize < 1 || chunkSize > MAX_CHUNK_BYTES) {
      throw new IllegalArgumentException(
          "chunkSize must be in [1, " + MAX_CHUNK_BYTES + "], got " + chunkSize);
    }
    this.versionLabel = versionLabel;
    this.tensors = List.copyOf(tensors).iterator();
    this.chunkSize = chunkSize;
  }

  /** The stream that loads a safetensors file (or folder, or index) on the server. */
  static Iterator<Admin.UpdateWeightsRequest> fromPath(String versionLabel, String path) {
    Admin.UpdateWeightsRequest load =
        Admin.UpdateWeightsRequest.newBuilder().setSafetensorsPath(path).build();
    return (versionLabel == null ? List.of(load) : List.of(label(versionLabel), load)).iterator();
  }

  @Override
  public boolean hasNext() {
    return versionLabel != null || current != null || tensors.hasNext();
  }

  @Override
  public Admin.UpdateWeightsRequest next() {
    if (!hasNext()) {
      throw new NoSuchElementException();
    }
    if (versionLabel != null) {
      Admin.UpdateWeightsRequest request = label(versionLabel);
      versionLabel = null;
      return request;
    }
    if (current == null) {
      current = tensors.next();
      sha256 = sha256(current.data());
      offset = 0;
    }
    byte[] data = current.data();
    int end = offset + Math.min(chunkSize, data.length - offset);
    Admin.TensorChunk chunk =
        Admin.TensorChunk.newBuilder()
            .setName(current.name())
            .setDtype(current.dtype())
            .addAllShape(current.shape())
            .setByteOffset(offset)
            .setData(ByteString.copyFrom(data, offset, end - offset))
            .setSha256(sha256)
            .build();
    offset = end;
    if (offset == data.length) {
      current = null;
    }
    return Admin.UpdateWeightsRequest.newBuilder().setChunk(chunk).build();
  }

  private static Admin.UpdateWeightsRequest label(String versionLabel) {
    return Admin.UpdateWeightsRequest.newBuilder().setVersionLabel(versionLabel).build();
  }

  private static String sha256(byte[] data) {
    try {
      return HexFormat.of().formatHex(MessageDigest.getInstance("SHA-256").digest(data));
    } catch (NoSuchAlgorithmException e) {
      throw new IllegalStateException("every Java platform has SHA-256", e);
    }
  }
}
