package dev.cbserve.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNotNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.grpc.CallOptions;
import io.grpc.Channel;
import io.grpc.ClientCall;
import io.grpc.ClientInterceptor;
import io.grpc.ClientInterceptors;
import io.grpc.Deadline;
import io.grpc.ForwardingClientCall;
import io.grpc.Grpc;
import io.grpc.InsecureChannelCredentials;
import io.grpc.ManagedChannel;
import io.grpc.Metadata;
import io.grpc.MethodDescriptor;
import io.grpc.Status;
import java.time.Duration;
import java.time.Instant;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.Test;

/** Deadlines, headers and the shape of chunks: what a call carries and what it returns. */
class ClientOptionsTest extends ServerTest {

  /** Records, per method name, the deadline and headers of the last call that reached the wire. */
  private static final class Recorder implements ClientInterceptor {
    final Map<String, Deadline> deadlines = new ConcurrentHashMap<>();
    final Map<String, Metadata> headers = new ConcurrentHashMap<>();

    @Override
    public <ReqT, RespT> ClientCall<ReqT, RespT> interceptCall(
        MethodDescriptor<ReqT, RespT> method, CallOptions options, Channel next) {
      String name = method.getBareMethodName();
      if (options.getDeadline() != null) {
        deadlines.put(name, options.getDeadline());
      } else {
        deadlines.remove(name);
      }
      return new ForwardingClientCall.SimpleForwardingClientCall<>(next.newCall(method, options)) {
        @Override
        public void start(Listener<RespT> listener, Metadata metadata) {
          headers.put(name, metadata);
          super.start(listener, metadata);
        }
      };
    }

    long secondsLeft(String method) {
      Deadline deadline = deadlines.get(method);
      assertNotNull(deadline, method + " had no deadline");
      return deadline.timeRemaining(TimeUnit.SECONDS);
    }
  }

  /** A channel to the test server whose calls pass through {@code recorder}. */
  private static ManagedChannel recordedChannel(Recorder recorder) {
    ManagedChannel channel =
        Grpc.newChannelBuilder(server.target, InsecureChannelCredentials.create()).build();
    return intercepted(channel, recorder);
  }

  @Test
  void streamingCallsGetTheDefaultStreamDeadlineAndOptionsOverrideIt() {
    Recorder recorder = new Recorder();
    ManagedChannel channel = recordedChannel(recorder);
    try (CbserveClient recorded = CbserveClient.builder().channel(channel).build()) {
      recorded.generate(Prompt.text("deadline"), greedy(2));
      long left = recorder.secondsLeft("Generate");
      assertTrue(left > 9 * 60 && left <= 10 * 60, "Generate deadline in " + left + " s, expected 10 min");
      String id = recorded.submit(Prompt.text("deadline"), greedy(2));
      assertTrue(recorder.secondsLeft("AddRequest") <= 60, "submit keeps the 60 s unary default");
      try (ChunkIterator chunks = recorded.results(id)) {
        drainTokens(chunks, 0);
      }
      assertTrue(recorder.secondsLeft("StreamResults") > 9 * 60);

      RequestOptions fiveSeconds = RequestOptions.builder().timeout(Duration.ofSeconds(5)).build();
      recorded.generate(Prompt.text("deadline"), greedy(2), fiveSeconds);
      assertTrue(recorder.secondsLeft("Generate") <= 5);
    } finally {
      ChannelShutdown.shutdown(channel);
    }
    try (CbserveClient noDeadline =
        CbserveClient.builder().channel(recordedChannel(recorder)).streamTimeout(null).build()) {
      noDeadline.generate(Prompt.text("deadline"), greedy(2));
      assertFalse(recorder.deadlines.containsKey("Generate"), "streamTimeout(null): no deadline");
    }
  }

  @Test
  void aStalledStreamEndsAtTheClientsStreamTimeout() throws InterruptedException {
    try (CbserveClient impatient =
        CbserveClient.builder().target(server.target).streamTimeout(Duration.ofMillis(300)).build()) {
      DeadlineExceededException e;
      try (PauseLease lease = admin.pause()) { // the request waits in the queue: no chunk comes
        assertTrue(lease.isHeld());
        e =
            assertThrows(
                DeadlineExceededException.class,
                () -> impatient.generate(Prompt.text("stalled"), greedy(4)));
      }
      assertTrue(e.getMessage().contains("300 ms"), e.getMessage());
      assertTrue(e.getMessage().contains("streamTimeout"), e.getMessage());
    }
    assertIdle();
  }

  @Test
  void requestOptionsHeadersAreSentWithTheCall() {
    Recorder recorder = new Recorder();
    ManagedChannel channel = recordedChannel(recorder);
    Metadata.Key<String> tenant = Metadata.Key.of("x-tenant", Metadata.ASCII_STRING_MARSHALLER);
    RequestOptions options =
        RequestOptions.builder().header("x-tenant", "blue").header("x-trace", "t-1").build();
    try (CbserveClient recorded = CbserveClient.builder().channel(channel).build()) {
      recorded.generate(Prompt.text("headers"), greedy(2), options);
      assertEquals("blue", recorder.headers.get("Generate").get(tenant));
      String id = recorded.submit(Prompt.text("headers"), greedy(2), options);
      assertEquals("blue", recorder.headers.get("AddRequest").get(tenant));
      try (ChunkIterator chunks = recorded.results(id, 0, options)) {
        drainTokens(chunks, 0);
      }
      assertEquals("blue", recorder.headers.get("StreamResults").get(tenant));
      recorded.generate(Prompt.text("headers"), greedy(2));
      assertEquals(null, recorder.headers.get("Generate").get(tenant), "headers are per call");
    } finally {
      ChannelShutdown.shutdown(channel);
    }
    assertThrows(IllegalArgumentException.class, () -> RequestOptions.builder().header("X-Up", "v"));
    assertThrows(IllegalArgumentException.class, () -> RequestOptions.builder().header("a-bin", "v"));
    assertThrows(IllegalArgumentException.class, () -> RequestOptions.builder().header("a", "\n"));
  }

  @Test
  void aChunkIteratorIsIterableOnce() {
    List<Chunk> chunks = new ArrayList<>();
    try (ChunkIterator stream = client.stream(Prompt.text("for-each"), greedy(3))) {
      for (Chunk chunk : stream) {
        chunks.add(chunk);
      }
      IllegalStateException again = assertThrows(IllegalStateException.class, stream::iterator);
      assertTrue(again.getMessage().contains("results("), again.getMessage());
    }
    assertEquals(RequestStatus.FINISHED, chunks.get(chunks.size() - 1).status());
  }

  @Test
  void chunksHaveTextInstantsStatusCodesAndUnboxedTokenIds() {
    Completion completion =
        client.generate(
            Prompt.text("shape"), greedy(4), RequestOptions.builder().recordTimestamps(true).build());
    TokenIds ids = completion.tokenIds();
    assertEquals(4, ids.toIntArray().length);
    assertEquals(ids.get(0).intValue(), ids.getInt(0));
    assertEquals(ids.intStream().boxed().toList(), ids);

    Timings timings = completion.timings();
    assertEquals(4, completion.tokenTimestamps().size());
    for (Instant at : completion.tokenTimestamps()) {
      // microsecond-exact conversion from the wire's epoch seconds
      assertFalse(at.isBefore(timings.queuedAt().minusMillis(1)), at + " before " + timings);
      assertFalse(at.isAfter(timings.finishedAt().plusMillis(1)), at + " after " + timings);
    }

    try (ChunkIterator stream = client.stream(Prompt.text("shape"), greedy(4))) {
      for (Chunk chunk : stream) {
        assertNotNull(chunk.text(), "text is never null");
        assertEquals(Status.Code.OK, chunk.errorCode());
        if (chunk.tokenIds().isEmpty()) {
          assertEquals("", chunk.text());
        }
      }
    }
  }

  private static ManagedChannel intercepted(ManagedChannel channel, Recorder recorder) {
    Channel wrapped = ClientInterceptors.intercept(channel, recorder);
    return new ManagedChannel() {
      @Override
      public ManagedChannel shutdown() {
        return channel.shutdown();
      }

      @Override
      public boolean isShutdown() {
        return channel.isShutdown();
      }

      @Override
      public boolean isTerminated() {
        return channel.isTerminated();
      }

      @Override
      public ManagedChannel shutdownNow() {
        return channel.shutdownNow();
      }

      @Override
      public boolean awaitTermination(long timeout, TimeUnit unit) throws InterruptedException {
        return channel.awaitTermination(timeout, unit);
      }

      @Override
      public <ReqT, RespT> ClientCall<ReqT, RespT> newCall(
          MethodDescriptor<ReqT, RespT> method, CallOptions options) {
        return wrapped.newCall(method, options);
      }

      @Override
      public String authority() {
        return channel.authority();
      }
    };
  }
}
