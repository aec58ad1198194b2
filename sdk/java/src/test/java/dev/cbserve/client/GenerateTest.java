package dev.cbserve.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNotNull;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.util.ArrayList;
import java.util.List;
import java.util.Optional;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.Test;

class GenerateTest extends ServerTest {

  @Test
  void modelInfoDescribesTheTinyModel() {
    ModelInfo info = client.modelInfo();
    assertEquals(CbserveServer.VOCAB_SIZE, info.vocabSize());
    assertTrue(info.hasTokenizer());
    assertTrue(info.maxContextLength() >= 64);
    assertTrue(info.weightVersion() >= 1, "weight versions start at 1 (WeightsTest raises it)");
  }

  @Test
  void greedyGenerateIsDeterministic() {
    Completion first = client.generate(Prompt.text("Hello"), greedy(16));
    Completion second = client.generate(Prompt.text("Hello"), greedy(16));
    assertEquals(16, first.tokenIds().size());
    assertEquals(first.tokenIds(), second.tokenIds());
    assertEquals(first.text(), second.text());
    assertEquals(FinishReason.LENGTH, first.finishReason());
    assertNotNull(first.usage());
    assertEquals(5, first.usage().promptTokens()); // one token per byte
    assertEquals(16, first.usage().generatedTokens());
    assertNotNull(first.text());
    assertTrue(first.logprobs().isEmpty());
  }

  @Test
  void streamYieldsTheSameTokensAsGenerate() {
    Completion completion = client.generate(Prompt.text("Once upon a time"), greedy(12));
    List<Chunk> chunks = new ArrayList<>();
    try (ChunkIterator stream = client.stream(Prompt.text("Once upon a time"), greedy(12))) {
      stream.forEachRemaining(chunks::add);
      assertFalse(stream.hasNext());
    }
    assertEquals(RequestStatus.QUEUED, chunks.get(0).status());
    Chunk last = chunks.get(chunks.size() - 1);
    assertEquals(RequestStatus.FINISHED, last.status());
    assertEquals(FinishReason.LENGTH, last.finishReason());
    List<Integer> tokens = new ArrayList<>();
    StringBuilder text = new StringBuilder();
    for (Chunk chunk : chunks) {
      assertEquals(chunks.get(0).requestId(), chunk.requestId());
      assertEquals(tokens.size(), chunk.tokenIds().isEmpty() ? tokens.size() : chunk.tokenIndex());
      tokens.addAll(chunk.tokenIds());
      if (chunk.text() != null) {
        text.append(chunk.text());
      }
    }
    assertEquals(completion.tokenIds(), tokens);
    assertEquals(completion.text(), text.toString());
  }

  @Test
  void aStopStringEndsTheOutputJustBeforeIt() {
    Completion full = client.generate(Prompt.text("Hello"), greedy(24));
    String text = full.text();
    // One character from the middle of the greedy output: the same greedy run must stop where that
    // character first appears (surrogate pairs kept whole).
    int middle = text.offsetByCodePoints(0, text.codePointCount(0, text.length()) / 2);
    String stop = text.substring(middle, text.offsetByCodePoints(middle, 1));
    String expected = text.substring(0, text.indexOf(stop));
    SamplingParams params =
        SamplingParams.builder()
            .maxNewTokens(24)
            .temperature(0)
            .ignoreEos(true)
            .stop("not in the output", stop)
            .build();

    Completion cut = client.generate(Prompt.text("Hello"), params);
    assertEquals(FinishReason.STOP, cut.finishReason(), "full output: " + text);
    assertEquals(expected, cut.text(), "stop " + stop + " in " + text);
    assertEquals(Optional.of(stop), cut.stopString());
    assertEquals(Optional.empty(), cut.stopTokenId());
    assertTrue(cut.tokenIds().size() < 24, cut.tokenIds().toString());
    assertEquals(full.tokenIds().subList(0, cut.tokenIds().size()), cut.tokenIds());

    StringBuilder streamed = new StringBuilder();
    Chunk last = null;
    try (ChunkIterator chunks = client.stream(Prompt.text("Hello"), params)) {
      while (chunks.hasNext()) {
        last = chunks.next();
        if (last.text() != null) {
          streamed.append(last.text());
        }
      }
    }
    assertEquals(expected, streamed.toString());
    assertEquals(FinishReason.STOP, last.finishReason());
    assertEquals(Optional.of(stop), last.stopString());
    assertEquals(Optional.empty(), last.stopTokenId());
  }

  @Test
  void tokenPromptsAndSeededSamplingAreReproducible() {
    SamplingParams sampled =
        SamplingParams.builder().maxNewTokens(10).temperature(0.9).topK(50).topP(0.95).seed(7).build();
    Completion a = client.generate(Prompt.tokens(1, 2, 3, 4), sampled);
    Completion b = client.generate(Prompt.tokens(List.of(1, 2, 3, 4)), sampled);
    assertEquals(10, a.tokenIds().size());
    assertEquals(a.tokenIds(), b.tokenIds());
    assertEquals(4, a.usage().promptTokens());
  }

  @Test
  void logprobsAndTimestampsComeWhenAsked() {
    SamplingParams params =
        SamplingParams.builder().maxNewTokens(6).temperature(0).logprobs(true).topLogprobs(3).build();
    Completion c =
        client.generate(
            Prompt.text("abc"), params, RequestOptions.builder().recordTimestamps(true).build());
    assertEquals(6, c.logprobs().size());
    assertEquals(6, c.tokenTimestamps().size());
    for (int i = 0; i < 6; i++) {
      TokenLogprob lp = c.logprobs().get(i);
      assertEquals(c.tokenIds().get(i), lp.tokenId());
      assertTrue(lp.logprob() <= 0);
      assertEquals(3, lp.top().size());
      // greedy: the chosen token is the most likely one
      assertEquals(lp.tokenId(), lp.top().get(0).tokenId());
    }
    assertNotNull(c.timings());
    assertNotNull(c.timings().finishedAt());
  }

  @Test
  void generateAsyncAgreesWithGenerate() throws Exception {
    Completion sync = client.generate(Prompt.text("async"), greedy(8));
    Completion async =
        client
            .generateAsync(
                Prompt.text("async"), greedy(8), RequestOptions.builder().requestId("async-1").build())
            .get(30, TimeUnit.SECONDS);
    assertEquals(sync.tokenIds(), async.tokenIds());
    assertEquals("async-1", async.requestId());
    assertEquals(
        admin.status().weightVersion(),
        client.modelInfoAsync().get(30, TimeUnit.SECONDS).weightVersion());
  }
}
