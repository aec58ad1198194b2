package dev.cbserve.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNotEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.time.Duration;
import java.util.List;
import java.util.Map;
import org.junit.jupiter.api.Test;

/**
 * What RL frameworks call, against the test server: logprobs of the distribution tokens are drawn
 * from, the prefix-cache reset (refused with a request in flight unless it aborts it), and the
 * weights' checksum (the server's digest of a pushed tensor equals {@link WeightsChecksums}', and
 * {@link WeightsChecksums#check} compares replicas).
 */
class RlFeaturesTest extends ServerTest {
  /** The test model (scripts/make_tiny_model.py) has a hidden size of 64: so have its norms. */
  private static final int HIDDEN_SIZE = 64;

  private static final String NORM = "model.norm.weight";

  private static Completion sample(LogprobsMode mode) {
    SamplingParams params =
        SamplingParams.builder()
            .maxNewTokens(6)
            .temperature(0.8f)
            .topK(2)
            .seed(3)
            .topLogprobs(5)
            .ignoreEos(true)
            .logprobsMode(mode)
            .build();
    return client.generate(Prompt.tokens(5, 6, 7, 8), params);
  }

  @Test
  void processedLogprobsAreThoseOfTheTopKTheTokenWasDrawnFrom() {
    Completion processed = sample(LogprobsMode.PROCESSED);
    Completion raw = sample(LogprobsMode.RAW);
    Completion byDefault = sample(LogprobsMode.SERVER_DEFAULT);
    assertEquals(raw.tokenIds(), processed.tokenIds(), "the mode changes what is reported, not what is drawn");
    for (int step = 0; step < processed.logprobs().size(); step++) {
      TokenLogprob kept = processed.logprobs().get(step);
      assertEquals(2, kept.top().size(), "step " + step + ": top-k kept two tokens");
      assertEquals(5, raw.logprobs().get(step).top().size(), "step " + step);
      assertEquals(5, byDefault.logprobs().get(step).top().size(), "the server's default is raw");
      double mass = Math.exp(kept.top().get(0).logprob()) + Math.exp(kept.top().get(1).logprob());
      assertEquals(1.0, mass, 1e-4, "step " + step + ": the two tokens kept carry all the probability");
      assertTrue(kept.logprob() >= raw.logprobs().get(step).logprob(), "step " + step);
    }
    assertTrue(SamplingParams.builder().logprobsMode(LogprobsMode.PROCESSED).build().toString()
        .contains("logprobsMode=PROCESSED"));
  }

  @Test
  void resetPrefixCacheIsRefusedWithARequestInFlightUnlessItAbortsIt() throws Exception {
    assertIdle();
    int[] prompt = new int[40]; // two full 16-token blocks at least
    for (int i = 0; i < prompt.length; i++) {
      prompt[i] = 10 + i;
    }
    client.generate(Prompt.tokens(prompt), greedy(1));
    PrefixCacheReset reset = admin.resetPrefixCache(false);
    assertTrue(reset.droppedBlocks() >= 2, reset.toString());
    assertEquals(0, reset.abortedRequests());

    String requestId;
    try (PauseLease lease = admin.pause()) { // the request stays queued while the pause holds
      assertTrue(lease.isHeld());
      requestId = client.submit(Prompt.tokens(5, 6, 7), greedy(4));
      FailedPreconditionException refused =
          assertThrows(FailedPreconditionException.class, () -> admin.resetPrefixCache(false));
      assertTrue(
          refused.details().contains("requests in flight (1 queued or running)"), refused.details());
      assertEquals(1, admin.resetPrefixCache(true).abortedRequests());
    }
    FinishReason last = null;
    try (ChunkIterator chunks = client.results(requestId)) {
      while (chunks.hasNext()) {
        last = chunks.next().finishReason();
      }
    }
    assertEquals(FinishReason.CANCELLED, last);
  }

  @Test
  void thePushedTensorsDigestOnTheServerEqualsTheClientsAndCheckNamesTheReplicaThatDiffers()
      throws Exception {
    WeightsChecksum original = admin.weightsChecksum(true);
    assertEquals(WeightsChecksums.ALGORITHM, original.algorithm());
    assertEquals(original.numTensors(), original.tensors().size());
    assertEquals(original.digest(), WeightsChecksums.combinedDigest(original.tensors()));
    assertTrue(admin.weightsChecksum(false).tensors().isEmpty(), "per-tensor digests on request only");

    Tensor zeros = Tensor.of(NORM, "F32", new byte[4 * HIDDEN_SIZE], HIDDEN_SIZE);
    try (CbserveServer replica = CbserveServer.replica(server.modelDir, "checksum-replica");
        CbserveAdminClient other =
            CbserveAdminClient.builder()
                .target(replica.adminTarget)
                .token(CbserveServer.ADMIN_TOKEN)
                .defaultTimeout(Duration.ofSeconds(30))
                .build()) {
      assertEquals(original.digest(), WeightsChecksums.check(null, List.of(admin, other)).digest());
      other.updateWeights(List.of(zeros));
      WeightsChecksum changed = other.weightsChecksum(true);
      assertEquals(WeightsChecksums.tensorDigest(zeros), changed.tensors().get(NORM).digest());
      assertNotEquals(original.digest(), changed.digest());

      WeightsMismatchException mismatch =
          assertThrows(
              WeightsMismatchException.class,
              () -> WeightsChecksums.check(original, List.of(admin, other)));
      assertEquals("expected", mismatch.reference());
      assertEquals(Map.of(other.target(), List.of(NORM)), mismatch.differing());
      assertTrue(
          mismatch.getMessage().startsWith(
              "1 of 2 replicas hold other weights than the expected weights: " + other.target()),
          mismatch.getMessage());
      assertTrue(mismatch.getMessage().contains(NORM), mismatch.getMessage());
    }
  }

  @Test
  void aTrainersChecksumOfEveryTensorIsTheDigestOfTheirDigests() {
    Tensor odd = Tensor.of("odd", "U8", new byte[] {1, 2, 3}, 3);
    Tensor zeros = Tensor.of(NORM, "F32", new byte[4 * HIDDEN_SIZE], HIDDEN_SIZE);
    WeightsChecksum checksum = WeightsChecksums.of(List.of(zeros, odd));
    assertEquals(List.of(NORM, "odd"), List.copyOf(checksum.tensors().keySet()));
    assertEquals(WeightsChecksums.combinedDigest(checksum.tensors()), checksum.digest());
    assertNotEquals(
        WeightsChecksums.tensorDigest(odd),
        WeightsChecksums.tensorDigest(Tensor.of("odd", "U8", new byte[] {1, 2, 4}, 3)));
    assertThrows(IllegalArgumentException.class, () -> WeightsChecksums.of(List.of(odd, odd)));
  }
}
