package dev.cbserve.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertInstanceOf;
import static org.junit.jupiter.api.Assertions.assertNotEquals;
import static org.junit.jupiter.api.Assertions.assertNotNull;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import cbserve.v1.Generation;
import cbserve.v1.GenerationServiceGrpc;
import cbserve.v1.Types;
import io.grpc.Grpc;
import io.grpc.InsecureChannelCredentials;
import io.grpc.ManagedChannel;
import java.time.Duration;
import java.util.ArrayList;
import java.util.HashSet;
import java.util.List;
import java.util.Set;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.Test;

/**
 * Parallel sampling (SamplingParams n) against the test server: n completions of one prompt, their
 * seeds, their interleaved streams, and the cancel of one sequence.
 */
class ParallelSamplingTest extends ServerTest {

  /** Sampled at temperature 1 (the whole distribution), exactly {@code tokens} new tokens. */
  private static SamplingParams.Builder sampled(int tokens) {
    return SamplingParams.builder().maxNewTokens(tokens).temperature(1).ignoreEos(true);
  }

  @Test
  void greedyNGivesNEqualCompletionsOrderedByIndex() {
    Completion single = client.generate(Prompt.text("Hello"), greedy(12));
    List<Completion> completions =
        client.generateN(
            Prompt.text("Hello"),
            3,
            greedy(12),
            RequestOptions.builder().requestId("n-greedy").build());
    assertEquals(3, completions.size());
    for (int i = 0; i < 3; i++) {
      Completion c = completions.get(i);
      assertEquals(i, c.index());
      assertEquals("n-greedy", c.requestId());
      assertEquals(single.tokenIds(), c.tokenIds(), "sequence " + i);
      assertEquals(single.text(), c.text(), "sequence " + i);
      assertEquals(FinishReason.LENGTH, c.finishReason());
      assertNotNull(c.usage());
      assertEquals(12, c.usage().generatedTokens(), "a sequence's own count");
      assertEquals(5, c.usage().promptTokens());
    }
    assertEquals(0, single.index());
  }

  @Test
  void seededSequenceIEqualsASingleRequestWithSeedPlusI() {
    // -2 also checks the wrap: the sequences' seeds are -2, -1 and 0 (2^64 - 2, 2^64 - 1, 0 as the
    // uint64 on the wire).
    for (long seed : new long[] {1234, -2}) {
      SamplingParams params = sampled(12).seed(seed).build();
      List<Completion> completions = client.generateN(Prompt.text("Once upon"), 3, params);
      Set<List<Integer>> distinct = new HashSet<>();
      for (int i = 0; i < 3; i++) {
        Completion alone =
            client.generate(Prompt.text("Once upon"), sampled(12).seed(seed + i).build());
        assertEquals(i, completions.get(i).index());
        assertEquals(
            alone.tokenIds(), completions.get(i).tokenIds(), "seed " + seed + ", sequence " + i);
        assertEquals(alone.text(), completions.get(i).text());
        distinct.add(completions.get(i).tokenIds());
      }
      assertTrue(distinct.size() > 1, "three seeds sampled the same 12 tokens: " + completions);
    }
  }

  @Test
  void nSetInTheParamsGivesTheSameCompletionsAsyncAndOverTheStream() throws Exception {
    SamplingParams params = sampled(10).seed(99).n(3).build();
    List<Completion> completions = client.generateN(Prompt.text("abc"), 3, params);
    List<Completion> async =
        client.generateNAsync(Prompt.text("abc"), 3, params).get(30, TimeUnit.SECONDS);
    assertEquals(tokens(completions), tokens(async));

    // stream(...) interleaves the sequences' chunks and ends once all three have ended.
    List<List<Integer>> streamed = List.of(new ArrayList<>(), new ArrayList<>(), new ArrayList<>());
    int[] terminal = new int[3];
    try (ChunkIterator chunks = client.stream(Prompt.text("abc"), params)) {
      for (Chunk chunk : chunks) {
        assertEquals(
            0, terminal[chunk.index()], "a chunk after sequence " + chunk.index() + " ended");
        List<Integer> own = streamed.get(chunk.index());
        if (!chunk.tokenIds().isEmpty()) {
          assertEquals(own.size(), chunk.tokenIndex(), "sequence " + chunk.index());
        }
        own.addAll(chunk.tokenIds());
        if (chunk.isFinished()) {
          terminal[chunk.index()]++;
          assertEquals(FinishReason.LENGTH, chunk.finishReason());
          assertEquals(10, chunk.usage().generatedTokens());
        }
      }
      assertFalse(chunks.hasNext());
    }
    assertEquals(List.of(1, 1, 1), List.of(terminal[0], terminal[1], terminal[2]));
    assertEquals(tokens(completions), streamed);
  }

  @Test
  void resultsFromAnIndexApplyToEverySequence() {
    String id = client.submit(Prompt.text("resume"), sampled(8).seed(5).n(2).build());
    List<List<Integer>> all = resultTokens(id, 0);
    assertEquals(8, all.get(0).size());
    assertEquals(8, all.get(1).size());
    List<List<Integer>> fromThree = resultTokens(id, 3);
    for (int i = 0; i < 2; i++) {
      assertEquals(all.get(i).subList(3, 8), fromThree.get(i), "sequence " + i);
    }
    assertEquals(
        all, tokens(client.generateN(Prompt.text("resume"), 2, sampled(8).seed(5).build())));
  }

  @Test
  void cancellingOneSequenceEndsItAloneAndTheOthersFinish() throws Exception {
    assertIdle();
    int max = 500;
    SamplingParams params =
        SamplingParams.builder().maxNewTokens(max).temperature(0).ignoreEos(true).n(3).build();
    List<List<Integer>> tokens = List.of(new ArrayList<>(), new ArrayList<>(), new ArrayList<>());
    Chunk[] last = new Chunk[3];
    boolean cancelled = false;
    try (ChunkIterator chunks =
        client.stream(
            Prompt.text("three long sequences"),
            params,
            RequestOptions.builder().requestId("n-cancel-one").build())) {
      for (Chunk chunk : chunks) {
        int i = chunk.index();
        assertNull(last[i], "a chunk after sequence " + i + " ended");
        tokens.get(i).addAll(chunk.tokenIds());
        if (chunk.isFinished()) {
          last[i] = chunk;
        }
        if (!cancelled && !tokens.get(1).isEmpty()) {
          // Sequence 1 is running (it has tokens, far fewer than max): cancel it alone.
          assertTrue(client.cancelSequence("n-cancel-one", 1));
          cancelled = true;
        }
      }
    }
    assertTrue(cancelled);
    assertEquals(RequestStatus.CANCELLED, last[1].status());
    assertEquals(FinishReason.CANCELLED, last[1].finishReason());
    assertTrue(tokens.get(1).size() < max, "sequence 1 ran to the end: " + tokens.get(1).size());
    assertEquals(tokens.get(1).size(), last[1].usage().generatedTokens());
    for (int i : new int[] {0, 2}) {
      assertEquals(RequestStatus.FINISHED, last[i].status(), "sequence " + i);
      assertEquals(FinishReason.LENGTH, last[i].finishReason(), "sequence " + i);
      assertEquals(max, tokens.get(i).size(), "sequence " + i);
    }
    // Greedy: the cancelled sequence's tokens are the start of the others'.
    assertEquals(tokens.get(0).subList(0, tokens.get(1).size()), tokens.get(1));
    assertEquals(tokens.get(0), tokens.get(2));
    assertFalse(client.cancelSequence("n-cancel-one", 1)); // already ended
    assertFalse(client.cancel("n-cancel-one"));
    assertIdle();
  }

  @Test
  void cancellingOneSequenceOfAGenerateNFuture() throws Exception {
    SamplingParams params = greedy(400);
    CompletableFuture<List<Completion>> future =
        client.generateNAsync(
            Prompt.text("cancel the middle one"),
            3,
            params,
            RequestOptions.builder().requestId("n-cancel-async").build());
    assertTrue(
        eventually(Duration.ofSeconds(10), () -> admin.status().activeRequests() > 0),
        "the request did not start: " + admin.status());
    assertTrue(client.cancelSequenceAsync("n-cancel-async", 2).get(30, TimeUnit.SECONDS));
    assertFalse(client.cancelSequence("n-cancel-async", 7)); // no such sequence
    List<Completion> completions = future.get(60, TimeUnit.SECONDS);
    assertEquals(FinishReason.LENGTH, completions.get(0).finishReason());
    assertEquals(FinishReason.LENGTH, completions.get(1).finishReason());
    assertEquals(FinishReason.CANCELLED, completions.get(2).finishReason());
    assertNotEquals(400, completions.get(2).tokenIds().size());
    assertEquals(400, completions.get(0).tokenIds().size());
    assertIdle();
  }

  @Test
  void cancellingAGenerateNFutureCancelsEverySequence() throws Exception {
    CompletableFuture<List<Completion>> future =
        client.generateNAsync(
            Prompt.text("cancel all three"),
            3,
            greedy(900),
            RequestOptions.builder().requestId("n-future-cancel").build());
    assertTrue(eventually(Duration.ofSeconds(10), () -> admin.status().activeRequests() > 0));
    assertTrue(future.cancel(true));
    assertTrue(
        eventually(Duration.ofSeconds(5), () -> admin.status().kvBlocksUsed() == 0),
        "KV blocks still used after cancelling the future: " + admin.status());
    // Past the last token, StreamResults sends each sequence's final chunk.
    Set<Integer> cancelled = new HashSet<>();
    try (ChunkIterator chunks =
        client.results("n-future-cancel", 100_000, Duration.ofSeconds(30))) {
      for (Chunk chunk : chunks) {
        if (chunk.isFinished()) {
          assertEquals(RequestStatus.CANCELLED, chunk.status(), "sequence " + chunk.index());
          cancelled.add(chunk.index());
        }
      }
    }
    assertEquals(Set.of(0, 1, 2), cancelled);
    assertIdle();
  }

  @Test
  void theServerRefusesAnNOutOfBoundsNamingSamplingN() {
    // The SDK refuses it before sending; past the SDK (a raw stub), the server's message names
    // sampling.n and the bound, and the SDK maps its status to InvalidArgumentException.
    Types.GenerationRequest request =
        CbserveClient.request(Prompt.text("x"), greedy(2), RequestOptions.defaults());
    Types.GenerationRequest tooMany =
        request.toBuilder()
            .setSampling(request.getSampling().toBuilder().setN(SamplingBounds.MAX_N + 1))
            .build();
    ManagedChannel channel =
        Grpc.newChannelBuilder(server.target, InsecureChannelCredentials.create()).build();
    try {
      var stub =
          GenerationServiceGrpc.newBlockingStub(channel).withDeadlineAfter(30, TimeUnit.SECONDS);
      CbserveException e =
          assertThrows(
              CbserveException.class,
              () ->
                  Calls.blocking(
                      () ->
                          stub.addRequest(
                              Generation.AddRequestRequest.newBuilder()
                                  .setRequest(tooMany)
                                  .build())));
      assertInstanceOf(InvalidArgumentException.class, e);
      assertTrue(e.getMessage().contains("sampling.n"), e.getMessage());
      assertTrue(e.getMessage().contains("128"), e.getMessage());
    } finally {
      channel.shutdownNow();
    }
  }

  private static List<List<Integer>> tokens(List<Completion> completions) {
    List<List<Integer>> out = new ArrayList<>();
    for (Completion c : completions) {
      out.add(List.copyOf(c.tokenIds()));
    }
    return out;
  }

  /** Each sequence's tokens from {@code fromIndex} on (StreamResults) of a request of n = 2. */
  private static List<List<Integer>> resultTokens(String id, int fromIndex) {
    List<List<Integer>> out = List.of(new ArrayList<>(), new ArrayList<>());
    try (ChunkIterator chunks = client.results(id, fromIndex, Duration.ofSeconds(30))) {
      for (Chunk chunk : chunks) {
        List<Integer> own = out.get(chunk.index());
        if (!chunk.tokenIds().isEmpty()) {
          assertEquals(fromIndex + own.size(), chunk.tokenIndex(), "sequence " + chunk.index());
        }
        own.addAll(chunk.tokenIds());
      }
    }
    return out;
  }
}
