package dev.cbserve.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertInstanceOf;
import static org.junit.jupiter.api.Assertions.assertNotEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import cbserve.v1.Types;
import io.grpc.Status;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.ExecutionException;
import org.junit.jupiter.api.Test;

/**
 * Health-checked balancing and the generation retries, against in-process {@link FakeReplica}s:
 * a replica that is not SERVING gets no call, and a generation that failed where nothing ran is
 * made again.
 */
class ReplicaFailoverTest {
  private static final SamplingParams PARAMS = SamplingParams.builder().maxNewTokens(2).build();

  private static CbserveClient client(String... targets) {
    return CbserveClient.builder()
        .targets(targets)
        .defaultTimeout(Duration.ofSeconds(10))
        .streamTimeout(Duration.ofSeconds(10))
        .build();
  }

  @Test
  void aReplicaThatIsNotServingGetsNoCallUntilItServes() throws Exception {
    try (FakeReplica loading = new FakeReplica();
        FakeReplica serving = new FakeReplica();
        CbserveClient client = client(loading.target(), serving.target())) {
      loading.serving(false);
      // Calls spread over half a second, so that both connections are up for most of them.
      for (int i = 0; i < 50; i++) {
        assertEquals("fake", client.modelInfo().modelName());
        Thread.sleep(10);
      }
      assertEquals(0, loading.modelInfoCalls(), "calls that reached the NOT_SERVING replica");

      loading.serving(true);
      assertTrue(
          ServerTest.eventually(
              Duration.ofSeconds(10),
              () -> client.modelInfo() != null && loading.modelInfoCalls() > 0),
          "the replica got no call within 10 s of turning SERVING");
    }
  }

  @Test
  void aGenerationRefusedBeforeItRanIsMadeAgain() throws Exception {
    try (FakeReplica replica = new FakeReplica();
        CbserveClient client = client(replica.target())) {
      replica.failNextGenerates(Status.UNAVAILABLE.withDescription("the model is still loading"));
      replica.rejectNextGenerates(1);
      Completion completion = client.generate(Prompt.text("hi"), PARAMS);
      assertEquals("ok", completion.text());
      assertEquals(3, replica.generated().size(), "Generate calls");

      replica.rejectNextGenerates(1);
      List<Chunk> chunks = new ArrayList<>();
      try (ChunkIterator stream = client.stream(Prompt.text("hi"), PARAMS)) {
        stream.forEach(chunks::add);
      }
      assertEquals(2, chunks.size(), "chunks after a draining replica: " + chunks);
      assertEquals(RequestStatus.QUEUED, chunks.get(0).status());

      replica.rejectNextGenerates(1);
      assertEquals(
          "ok", client.generateAsync(Prompt.text("hi"), PARAMS).get().text(), "generateAsync");

      int before = replica.generated().size();
      replica.failNextGenerates(Status.INTERNAL.withDescription("bug"));
      assertThrows(InternalException.class, () -> client.generate(Prompt.text("hi"), PARAMS));
      assertEquals(before + 1, replica.generated().size(), "an INTERNAL failure is not retried");
    }
  }

  @Test
  void aGenerationWhoseStreamBrokeIsMadeAgainOnlyWhereTheCallerSawNothing() throws Exception {
    Status broken = Status.UNAVAILABLE.withDescription("the connection closed");
    try (FakeReplica replica = new FakeReplica();
        CbserveClient client = client(replica.target())) {
      replica.breakNextGenerates(broken);
      Completion completion = client.generate(Prompt.text("hi"), PARAMS);
      assertEquals("ok", completion.text());
      List<Types.GenerationRequest> requests = replica.generated();
      assertEquals(2, requests.size(), "generate over a stream that broke");
      assertNotEquals(requests.get(0).getRequestId(), requests.get(1).getRequestId());
      assertEquals(requests.get(1).getRequestId(), completion.requestId());

      replica.breakNextGenerates(broken);
      assertEquals("ok", client.generateAsync(Prompt.text("hi"), PARAMS).get().text());

      // The stream's QUEUED chunk was read: its failure is the caller's to see.
      replica.breakNextGenerates(broken);
      try (ChunkIterator stream = client.stream(Prompt.text("hi"), PARAMS)) {
        assertEquals(RequestStatus.QUEUED, stream.next().status());
        assertThrows(UnavailableException.class, stream::hasNext);
      }

      // An id the caller chose is not replaced: the failure is the caller's.
      int before = replica.generated().size();
      replica.breakNextGenerates(broken);
      RequestOptions mine = RequestOptions.builder().requestId("mine").build();
      assertThrows(
          UnavailableException.class, () -> client.generate(Prompt.text("hi"), PARAMS, mine));
      ExecutionException async =
          assertThrows(
              ExecutionException.class,
              () -> {
                replica.breakNextGenerates(broken);
                client
                    .generateAsync(
                        Prompt.text("hi"), PARAMS, RequestOptions.builder().requestId("m2").build())
                    .get();
              });
      assertInstanceOf(UnavailableException.class, async.getCause());
      assertEquals(before + 2, replica.generated().size());
    }
  }

  @Test
  void withNoReplicaServingACallReachesOneWhichSaysWhy() throws Exception {
    Status loading = Status.UNAVAILABLE.withDescription("the model is still loading");
    try (FakeReplica lone = new FakeReplica();
        CbserveClient client = client(lone.target())) {
      lone.serving(false);
      lone.failNextGenerates(loading, loading, loading, loading);
      UnavailableException e =
          assertThrows(
              UnavailableException.class, () -> client.generate(Prompt.text("hi"), PARAMS));
      assertEquals("UNAVAILABLE: the model is still loading", e.getMessage());
      assertEquals(Retries.MAX_ATTEMPTS, lone.generated().size(), "Generate calls");

      // A replica that serves before its health says so serves the call.
      assertEquals("ok", client.generate(Prompt.text("hi"), PARAMS).text());
      assertEquals("ok", client.generateAsync(Prompt.text("hi"), PARAMS).get().text());
      try (ChunkIterator stream = client.stream(Prompt.text("hi"), PARAMS)) {
        assertEquals(RequestStatus.QUEUED, stream.next().status());
      }
      assertEquals("fake", client.modelInfo().modelName());
      assertEquals("fake", client.modelInfoAsync().get().modelName());
    }
  }

  @Test
  void withNoReplicaServingASessionReachesOneWhichSaysWhyOrServesIt() throws Exception {
    Status loading = Status.UNAVAILABLE.withDescription("the model is still loading");
    try (FakeReplica lone = new FakeReplica();
        CbserveClient client = client(lone.target())) {
      lone.serving(false);
      lone.failNextGenerates(loading);
      try (GenerateSession session = client.session()) {
        UnavailableException e =
            assertThrows(
                UnavailableException.class, () -> session.generate(Prompt.text("hi"), PARAMS));
        assertEquals("UNAVAILABLE: the model is still loading", e.getMessage());
      }

      // A replica that serves before its health says so serves every request the session sent.
      try (GenerateSession session = client.session()) {
        List<ChunkIterator> streams = new ArrayList<>();
        for (int i = 0; i < 3; i++) {
          streams.add(session.stream(Prompt.text("hi " + i), PARAMS));
        }
        for (ChunkIterator stream : streams) {
          StringBuilder text = new StringBuilder();
          stream.forEachRemaining(chunk -> text.append(chunk.text() == null ? "" : chunk.text()));
          assertEquals("ok", text.toString(), "request " + stream.requestId());
        }
      }
    }
  }
}
