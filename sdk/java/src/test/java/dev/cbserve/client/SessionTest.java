package dev.cbserve.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import org.junit.jupiter.api.Test;

/** A {@link GenerateSession}'s requests against the run's server: many on one call. */
class SessionTest extends ServerTest {
  private static final String LONG_PROMPT =
      "a prompt long enough to hold a few KV blocks of sixteen tokens";

  /** Reads a stream until its first chunk with tokens. */
  private static void firstToken(ChunkIterator chunks) {
    while (chunks.next().tokenIds().isEmpty()) {
      continue;
    }
  }

  /** Reads a stream to its end. */
  private static void drain(ChunkIterator chunks) {
    chunks.forEachRemaining(chunk -> {});
  }

  @Test
  void requestsFromManyThreadsEqualTheirOwnCalls() throws Exception {
    List<String> prompts = List.of("Once upon a time", "The capital of France", "A session");
    List<List<Integer>> want = new ArrayList<>();
    for (String prompt : prompts) {
      want.add(client.generate(Prompt.text(prompt), greedy(16)).tokenIds());
    }
    ExecutorService pool = Executors.newFixedThreadPool(prompts.size());
    try (GenerateSession session = client.session()) {
      List<Future<List<Integer>>> got = new ArrayList<>();
      for (int i = 0; i < prompts.size(); i++) {
        Prompt prompt = Prompt.text(prompts.get(i));
        got.add(
            i == 0 // one through stream, the others through generate
                ? pool.submit(() -> drainTokens(session.stream(prompt, greedy(16)), 0))
                : pool.submit(() -> session.generate(prompt, greedy(16)).tokenIds()));
      }
      for (int i = 0; i < prompts.size(); i++) {
        assertEquals(want.get(i), got.get(i).get(), "prompt " + prompts.get(i));
      }
    } finally {
      pool.shutdown();
    }
  }

  @Test
  void closingOneRequestsIteratorCancelsThatRequestOnly() throws Exception {
    try (GenerateSession session = client.session()) {
      ChunkIterator kept = session.stream(Prompt.text("kept"), greedy(24));
      ChunkIterator dropped = session.stream(Prompt.text(LONG_PROMPT), greedy(900));
      firstToken(dropped);
      dropped.close();
      assertFalse(dropped.hasNext());
      assertEquals(24, drainTokens(kept, 0).size());
      assertEquals(
          RequestStatus.CANCELLED, RequestLifecycleTest.finalChunk(dropped.requestId()).status());
      assertEquals(
          RequestStatus.FINISHED, RequestLifecycleTest.finalChunk(kept.requestId()).status());
    }
    assertIdle();
  }

  @Test
  void aRefusedRequestThrowsFromItsIteratorAndTheSessionGoesOn() {
    try (GenerateSession session = client.session()) {
      ChunkIterator refused = session.stream(Prompt.tokens(1_000_000), greedy(4));
      assertThrows(InvalidArgumentException.class, refused::hasNext);
      assertEquals(
          client.generate(Prompt.text("Hello"), greedy(8)).tokenIds(),
          session.generate(Prompt.text("Hello"), greedy(8)).tokenIds());
    }
  }

  @Test
  void aRequestIdThatAnOpenRequestHasIsRefused() {
    RequestOptions options = RequestOptions.builder().requestId("session-duplicate").build();
    try (GenerateSession session = client.session();
        ChunkIterator first = session.stream(Prompt.text("first"), greedy(900), options)) {
      IllegalArgumentException e =
          assertThrows(
              IllegalArgumentException.class,
              () -> session.stream(Prompt.text("second"), greedy(4), options));
      assertTrue(e.getMessage().contains("session-duplicate"), e.getMessage());
      firstToken(first);
    }
  }

  @Test
  void aRequestsTimeoutCancelsItAlone() throws Exception {
    RequestOptions timed = RequestOptions.builder().timeout(Duration.ofSeconds(2)).build();
    try (GenerateSession session = client.session()) {
      ChunkIterator chunks = session.stream(Prompt.text(LONG_PROMPT), greedy(900), timed);
      firstToken(chunks);
      try (PauseLease lease = admin.pause()) {
        assertTrue(lease.isHeld()); // no chunk comes: the request's deadline passes
        DeadlineExceededException e =
            assertThrows(DeadlineExceededException.class, () -> drain(chunks));
        assertTrue(e.getMessage().contains("2 s (RequestOptions.timeout)"), e.getMessage());
      }
      assertEquals(
          RequestStatus.CANCELLED, RequestLifecycleTest.finalChunk(chunks.requestId()).status());
      assertEquals(4, session.generate(Prompt.text("after"), greedy(4)).tokenIds().size());
    }
    assertIdle();
  }

  @Test
  void closingTheSessionCancelsItsRequestsAndTakesNoNewOne() throws Exception {
    GenerateSession session = client.session();
    ChunkIterator chunks = session.stream(Prompt.text(LONG_PROMPT), greedy(900));
    firstToken(chunks);
    session.close();
    CancelledException e = assertThrows(CancelledException.class, () -> drain(chunks));
    assertTrue(e.getMessage().contains("the session was closed"), e.getMessage());
    assertThrows(CancelledException.class, () -> session.stream(Prompt.text("late"), greedy(2)));
    assertEquals(
        RequestStatus.CANCELLED, RequestLifecycleTest.finalChunk(chunks.requestId()).status());
    assertIdle();
  }
}
