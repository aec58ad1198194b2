package dev.cbserve.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.util.Collections;
import java.util.List;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.function.Executable;

/** AdminService.UpdateWeights against the test server. */
class WeightsTest extends ServerTest {
  /** The test model (scripts/make_tiny_model.py) has a hidden size of 64: so have its norms. */
  private static final int HIDDEN_SIZE = 64;

  private static final String NORM = "model.norm.weight";
  private static final String LAYER_NORM = "model.layers.0.input_layernorm.weight";

  /**
   * A zero final norm zeroes the last hidden states, hence every logit: greedy decoding then picks
   * token 0 at every step.
   */
  private static Tensor zeroNorm() {
    return Tensor.of(NORM, "F32", new byte[4 * HIDDEN_SIZE], HIDDEN_SIZE);
  }

  private static Completion generate() {
    return client.generate(Prompt.text("new weights"), greedy(8));
  }

  @Test
  void updateWeightsReplacesTensorsAndTheModelFileRestoresThem() {
    long before = admin.status().weightVersion();
    List<Integer> original = generate().tokenIds();
    WeightsUpdate restored;
    try {
      WeightsUpdate update = admin.updateWeights(List.of(zeroNorm()), "zero-norm");
      assertEquals(new WeightsUpdate(before + 1, 1, "zero-norm"), update);
      assertEquals(before + 1, admin.status().weightVersion());
      Completion zeroed = generate();
      assertEquals(Collections.nCopies(8, 0), zeroed.tokenIds());
      assertEquals(before + 1, zeroed.weightVersion());
    } finally {
      // The model's own safetensors file, read by the server, puts the original weights back.
      restored = admin.updateWeightsFromPath(server.modelDir.toString());
    }
    assertEquals(before + 2, restored.weightVersion());
    assertTrue(restored.tensorsUpdated() > 1, "every tensor of the model: " + restored);
    assertEquals("", restored.versionLabel());
    assertEquals(original, generate().tokenIds());
  }

  @Test
  void aStreamLargerThanTheTransportBufferIsSentWhole() {
    long before = admin.status().weightVersion();
    // The 64 KiB embedding in 1 KiB chunks: more than gRPC buffers before isReady() turns false,
    // so the sender has to wait for the transport and resume.
    int vocabSize = CbserveServer.VOCAB_SIZE;
    Tensor embedding =
        Tensor.of(
            "model.embed_tokens.weight",
            "F32",
            new byte[4 * vocabSize * HIDDEN_SIZE],
            vocabSize,
            HIDDEN_SIZE);
    try {
      WeightsUpdate update =
          admin.send(new UpdateWeightsRequests(null, List.of(embedding), 1024), null);
      assertEquals(new WeightsUpdate(before + 1, 1, ""), update);
    } finally {
      admin.updateWeightsFromPath(server.modelDir.toString());
    }
  }

  @Test
  void aRejectedUpdateChangesNothing() {
    long before = admin.status().weightVersion();
    List<Integer> original = generate().tokenIds();
    // Each update sends the zero norm first: the server must not apply it either.
    Tensor wrongShape = Tensor.of(LAYER_NORM, "F32", new byte[128], 32);
    assertRejected("does not match", () -> admin.updateWeights(List.of(zeroNorm(), wrongShape)));
    Tensor unknown = Tensor.of("model.no_such.weight", "F32", new byte[4], 1);
    assertRejected("no parameter", () -> admin.updateWeights(List.of(zeroNorm(), unknown)));
    Tensor integers = Tensor.of(LAYER_NORM, "I32", new byte[4 * HIDDEN_SIZE], HIDDEN_SIZE);
    assertRejected("cannot be converted", () -> admin.updateWeights(List.of(zeroNorm(), integers)));
    String missing = server.modelDir.resolve("no-such.safetensors").toString();
    assertRejected("no such safetensors file", () -> admin.updateWeightsFromPath(missing));
    assertEquals(before, admin.status().weightVersion());
    assertEquals(original, generate().tokenIds());
  }

  private static void assertRejected(String reason, Executable update) {
    InvalidArgumentException e = assertThrows(InvalidArgumentException.class, update);
    assertTrue(e.details().contains(reason), e.details() + " does not say: " + reason);
  }
}
