package dev.cbserve.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertTrue;
import static org.junit.jupiter.api.Assertions.fail;

import java.time.Duration;
import java.util.List;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.Test;

/** submit / results / cancel, and cancellation by closing a stream or cancelling a future. */
class RequestLifecycleTest extends ServerTest {

  /** The last chunk of a request (read with StreamResults past its last token). */
  static Chunk finalChunk(String requestId) {
    try (ChunkIterator chunks = client.results(requestId, 100_000, Duration.ofSeconds(30))) {
      Chunk last = null;
      while (chunks.hasNext()) {
        last = chunks.next();
      }
      return last;
    }
  }

  @Test
  void resultsFromIndexReturnExactlyTheTokensFromThere() {
    String id = client.submit(Prompt.text("resume me"), greedy(12));
    List<Integer> all;
    try (ChunkIterator chunks = client.results(id, 0)) {
      assertEquals(id, chunks.requestId());
      all = drainTokens(chunks, 0);
    }
    assertEquals(12, all.size());
    for (int k : new int[] {1, 5, 11, 12}) {
      try (ChunkIterator chunks = client.results(id, k)) {
        assertEquals(all.subList(k, all.size()), drainTokens(chunks, k), "from index " + k);
      }
    }
    // Same tokens as the Generate stream for the same greedy request.
    assertEquals(all, client.generate(Prompt.text("resume me"), greedy(12)).tokenIds());
    assertEquals(RequestStatus.FINISHED, finalChunk(id).status());
    assertFalse(client.cancel(id)); // already ended
  }

  @Test
  void submitAsyncAndCancel() throws Exception {
    String id =
        client
            .submitAsync(Prompt.text("long"), greedy(900))
            .get(30, TimeUnit.SECONDS);
    assertTrue(client.cancelAsync(id).get(30, TimeUnit.SECONDS));
    Chunk last = finalChunk(id);
    assertEquals(RequestStatus.CANCELLED, last.status());
    assertEquals(FinishReason.CANCELLED, last.finishReason());
    assertFalse(client.cancel(id));
    assertIdle();
  }

  @Test
  void closingTheStreamCancelsTheRequestAndFreesItsBlocks() throws Exception {
    assertIdle();
    String id;
    try (ChunkIterator chunks =
        client.stream(
            Prompt.text("a prompt long enough to hold a few KV blocks of sixteen tokens"),
            greedy(900))) {
      id = chunks.requestId();
      Chunk chunk;
      do {
        chunk = chunks.next();
      } while (chunk.tokenIds().isEmpty());
      // (the status is a snapshot taken at the end of an engine step)
      assertTrue(
          eventually(Duration.ofSeconds(3), () -> admin.status().kvBlocksUsed() > 0),
          "the running request holds KV blocks: " + admin.status());
    }
    // Within a few seconds the server has cancelled the request and freed its blocks.
    if (!eventually(Duration.ofSeconds(5), () -> admin.status().kvBlocksUsed() == 0)) {
      fail("KV blocks still used after closing the stream: " + admin.status());
    }
    Chunk last = finalChunk(id);
    assertEquals(RequestStatus.CANCELLED, last.status());
    assertTrue(last.usage().generatedTokens() < 900);
    assertIdle();
  }

  @Test
  void cancellingAGenerateFutureCancelsTheRequest() throws Exception {
    CompletableFuture<Completion> future =
        client.generateAsync(
            Prompt.text("cancel me"),
            greedy(900),
            RequestOptions.builder().requestId("future-cancel").build());
    assertTrue(eventually(Duration.ofSeconds(10), () -> admin.status().activeRequests() > 0));
    assertTrue(future.cancel(true));
    assertTrue(eventually(Duration.ofSeconds(5), () -> admin.status().kvBlocksUsed() == 0));
    assertEquals(RequestStatus.CANCELLED, finalChunk("future-cancel").status());
  }
}
