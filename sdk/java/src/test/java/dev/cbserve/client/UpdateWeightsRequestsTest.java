package dev.cbserve.client;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import cbserve.v1.Admin;
import java.io.ByteArrayOutputStream;
import java.security.MessageDigest;
import java.util.ArrayList;
import java.util.HexFormat;
import java.util.List;
import org.junit.jupiter.api.Test;

/** The UpdateWeights stream the client builds, and the checks on a Tensor (no server). */
class UpdateWeightsRequestsTest {

  @Test
  void eachTensorIsSentInConsecutiveChunksWithTheSha256OfTheWholeTensor() throws Exception {
    byte[] data = new byte[250];
    for (int i = 0; i < data.length; i++) {
      data[i] = (byte) i;
    }
    List<Tensor> tensors =
        List.of(Tensor.of("a", "U8", data, 10, 25), Tensor.of("empty", "F32", new byte[0], 0, 3));
    List<Admin.UpdateWeightsRequest> sent = new ArrayList<>();
    new UpdateWeightsRequests("step-7", tensors, 100).forEachRemaining(sent::add);

    assertEquals("step-7", sent.get(0).getVersionLabel());
    String sha256 = hex(MessageDigest.getInstance("SHA-256").digest(data));
    String emptySha256 = hex(MessageDigest.getInstance("SHA-256").digest(new byte[0]));
    List<String> expected =
        List.of(
            "a U8 [10, 25] @0 +100 " + sha256,
            "a U8 [10, 25] @100 +100 " + sha256,
            "a U8 [10, 25] @200 +50 " + sha256,
            "empty F32 [0, 3] @0 +0 " + emptySha256);
    List<String> chunks = new ArrayList<>();
    ByteArrayOutputStream reassembled = new ByteArrayOutputStream();
    for (Admin.UpdateWeightsRequest request : sent.subList(1, sent.size())) {
      Admin.TensorChunk c = request.getChunk();
      chunks.add(
          c.getName() + " " + c.getDtype() + " " + c.getShapeList() + " @" + c.getByteOffset()
              + " +" + c.getData().size() + " " + c.getSha256());
      if (c.getName().equals("a")) {
        c.getData().writeTo(reassembled);
      }
    }
    assertEquals(expected, chunks);
    assertArrayEquals(data, reassembled.toByteArray());
  }

  @Test
  void noLabelMeansNoLabelMessage() {
    UpdateWeightsRequests requests =
        new UpdateWeightsRequests(null, List.of(Tensor.of("x", "I8", new byte[1], 1)), 100);
    assertTrue(requests.next().hasChunk());
    assertFalse(requests.hasNext());
  }

  @Test
  void chunkSizeIsBoundedByTheProtocol() {
    List<Tensor> one = List.of(Tensor.of("x", "I8", new byte[1], 1));
    assertThrows(IllegalArgumentException.class, () -> new UpdateWeightsRequests(null, one, 0));
    assertThrows(
        IllegalArgumentException.class,
        () -> new UpdateWeightsRequests(null, one, UpdateWeightsRequests.MAX_CHUNK_BYTES + 1));
  }

  @Test
  void malformedTensorsAreRefusedWithTheReason() {
    assertMessage("no name", () -> Tensor.of("", "F32", new byte[4], 1));
    assertMessage("unknown dtype 'float32'", () -> Tensor.of("x", "float32", new byte[4], 1));
    assertMessage("negative dimension", () -> Tensor.of("x", "U8", new byte[0], -1));
    assertMessage("needs 12 bytes, data has 6", () -> Tensor.of("x", "BF16", new byte[6], 2, 3));
  }

  @Test
  void tensorsCompareByContent() {
    Tensor tensor = Tensor.of("x", "U8", new byte[] {1, 2}, 2);
    assertEquals(tensor, Tensor.of("x", "U8", new byte[] {1, 2}, 2));
    assertEquals(tensor.hashCode(), Tensor.of("x", "U8", new byte[] {1, 2}, 2).hashCode());
    assertEquals("Tensor[x, U8, shape [2], 2 bytes]", tensor.toString());
  }

  private static void assertMessage(String expected, Runnable build) {
    IllegalArgumentException e = assertThrows(IllegalArgumentException.class, build::run);
    assertTrue(e.getMessage().contains(expected), e.getMessage() + " does not say: " + expected);
  }

  private static String hex(byte[] digest) {
    return HexFormat.of().formatHex(digest);
  }
}
