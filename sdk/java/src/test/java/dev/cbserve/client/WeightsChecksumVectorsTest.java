package dev.cbserve.client;

import static org.junit.jupiter.api.Assertions.assertEquals;

import com.google.gson.JsonElement;
import com.google.gson.JsonObject;
import com.google.gson.JsonParser;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import org.junit.jupiter.api.Test;

/**
 * The weights checksum's vectors, shared with the Python and Go SDKs' tests: byte i of a tensor's
 * data is (i * 131 + seed) mod 256. No server: the digest is computed here alone.
 */
class WeightsChecksumVectorsTest {
  private static final Map<String, Integer> DTYPE_SIZES =
      Map.of("F32", 4, "BF16", 2, "F16", 2, "I64", 8, "U8", 1);

  @Test
  void everyTensorAndTheModelHaveTheSharedVectorsDigests() throws IOException {
    Path file = Path.of("..", "..", "tests", "data", "weights_checksum_vectors.json");
    JsonObject vectors =
        JsonParser.parseString(Files.readString(file, StandardCharsets.UTF_8)).getAsJsonObject();
    assertEquals(vectors.get("algorithm").getAsString(), WeightsChecksums.ALGORITHM);
    List<Tensor> tensors = new ArrayList<>();
    for (JsonElement element : vectors.getAsJsonArray("tensors")) {
      JsonObject vector = element.getAsJsonObject();
      String name = vector.get("name").getAsString();
      String dtype = vector.get("dtype").getAsString();
      long[] shape =
          vector.getAsJsonArray("shape").asList().stream().mapToLong(JsonElement::getAsLong).toArray();
      long size = DTYPE_SIZES.get(dtype);
      for (long dim : shape) {
        size *= dim;
      }
      int seed = vector.get("seed").getAsInt();
      byte[] data = new byte[(int) size];
      for (int i = 0; i < data.length; i++) {
        data[i] = (byte) ((i * 131 + seed) % 256);
      }
      Tensor tensor = Tensor.of(name, dtype, data, shape);
      assertEquals(vector.get("digest").getAsString(), WeightsChecksums.tensorDigest(tensor), name);
      tensors.add(tensor);
    }
    assertEquals(vectors.get("digest").getAsString(), WeightsChecksums.of(tensors).digest());
  }
}
