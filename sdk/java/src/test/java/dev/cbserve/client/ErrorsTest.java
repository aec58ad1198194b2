package dev.cbserve.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.grpc.Status;
import java.io.IOException;
import java.net.InetAddress;
import java.net.ServerSocket;
import java.time.Duration;
import java.util.Arrays;
import java.util.Locale;
import java.util.Map;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.Test;

/** Status codes map to the exception hierarchy, on every path (unary, stream, Generate chunk). */
class ErrorsTest extends ServerTest {

  @Test
  void emptyPromptIsInvalidArgument() {
    InvalidArgumentException e =
        assertThrows(InvalidArgumentException.class, () -> client.generate(Prompt.text(""), greedy(4)));
    assertEquals(Status.Code.INVALID_ARGUMENT, e.code());
    assertTrue(e.details().contains("text"), e.details());
    assertThrows(InvalidArgumentException.class, () -> client.generate(Prompt.tokens(), greedy(4)));
    assertThrows(InvalidArgumentException.class, () -> client.submit(Prompt.text(""), greedy(4)));
  }

  @Test
  void tokenIdOutsideTheVocabularyIsInvalidArgument() {
    InvalidArgumentException e =
        assertThrows(
            InvalidArgumentException.class, () -> client.generate(Prompt.tokens(1, 999), greedy(4)));
    assertTrue(e.details().contains("999"), e.details());
    assertThrows(
        InvalidArgumentException.class, () -> client.submit(Prompt.tokens(999), greedy(4)));
    ExecutionException async =
        assertThrows(
            ExecutionException.class,
            () -> client.generateAsync(Prompt.tokens(999), greedy(4)).get(30, TimeUnit.SECONDS));
    assertTrue(async.getCause() instanceof InvalidArgumentException, async.getCause().toString());
  }

  @Test
  void boundsThatDependOnTheModelAreLeftToTheServer() {
    // The client checks the shared bounds table; the vocabulary size is the server's to check.
    SamplingParams outsideVocab =
        SamplingParams.builder().maxNewTokens(4).logitBias(Map.of(999, 1.0)).build();
    InvalidArgumentException e =
        assertThrows(
            InvalidArgumentException.class, () -> client.generate(Prompt.text("hi"), outsideVocab));
    assertEquals(Status.Code.INVALID_ARGUMENT, e.code());
    assertTrue(e.details().contains("999"), e.details());
    assertThrows(
        InvalidArgumentException.class, () -> client.submit(Prompt.text("hi"), outsideVocab));
  }

  @Test
  void theClientBoundsMatchTheServers() {
    // Just inside each bound, the server accepts the request too.
    String[] stops = new String[SamplingBounds.MAX_STOP_STRINGS];
    Arrays.fill(stops, "x".repeat(SamplingBounds.MAX_STOP_STRING_CHARS));
    SamplingParams atTheBounds =
        SamplingParams.builder()
            .maxNewTokens(SamplingBounds.MIN_MAX_NEW_TOKENS)
            .temperature(0)
            .topLogprobs(SamplingBounds.MAX_TOP_LOGPROBS)
            .presencePenalty(-SamplingBounds.MAX_ABS_PRESENCE_FREQUENCY_PENALTY)
            .frequencyPenalty(SamplingBounds.MAX_ABS_PRESENCE_FREQUENCY_PENALTY)
            .logitBias(Map.of(1, SamplingBounds.MAX_ABS_LOGIT_BIAS))
            .stop(stops)
            .build();
    RequestOptions longestId =
        RequestOptions.builder().requestId("i".repeat(SamplingBounds.MAX_REQUEST_ID_BYTES)).build();
    Completion c = client.generate(Prompt.text("hi"), atTheBounds, longestId);
    assertEquals(SamplingBounds.MIN_MAX_NEW_TOKENS, c.tokenIds().size());
    assertEquals(SamplingBounds.MAX_TOP_LOGPROBS, c.logprobs().get(0).top().size());
  }

  @Test
  void unknownRequestIdIsNotFound() {
    try (ChunkIterator chunks = client.results("no-such-request", 0)) {
      NotFoundException e = assertThrows(NotFoundException.class, chunks::hasNext);
      assertEquals(Status.Code.NOT_FOUND, e.code());
    }
    assertEquals(false, client.cancel("no-such-request")); // Cancel is idempotent
  }

  @Test
  void duplicateLiveIdIsAlreadyExists() throws InterruptedException {
    RequestOptions id = RequestOptions.builder().requestId("duplicate-id").build();
    client.submit(Prompt.text("first"), greedy(900), id);
    try {
      assertThrows(
          AlreadyExistsException.class, () -> client.submit(Prompt.text("second"), greedy(4), id));
      assertThrows(
          AlreadyExistsException.class, () -> client.generate(Prompt.text("second"), greedy(4), id));
    } finally {
      client.cancel("duplicate-id");
    }
    assertIdle();
  }

  @Test
  void deadlinesAreDeadlineExceeded() throws InterruptedException {
    String id = client.submit(Prompt.text("slow"), greedy(900));
    try (ChunkIterator chunks = client.results(id, 0, Duration.ofMillis(200))) {
      DeadlineExceededException e =
          assertThrows(DeadlineExceededException.class, () -> drainTokens(chunks, 0));
      // The deadline the caller set and the knob to change, not grpc-java's transport internals.
      assertTrue(e.getMessage().contains("200 ms"), e.getMessage());
      assertTrue(e.getMessage().contains("RequestOptions.timeout"), e.getMessage());
      for (String internal : new String[] {"buffered_nanos", "remote_addr", "Name resolution"}) {
        assertFalse(e.getMessage().contains(internal), e.getMessage());
      }
    } finally {
      client.cancel(id);
    }
    assertIdle();
  }

  @Test
  void unreachableServerIsUnavailable() throws IOException {
    int port;
    try (ServerSocket socket = new ServerSocket(0, 1, InetAddress.getByName("127.0.0.1"))) {
      port = socket.getLocalPort();
    }
    try (CbserveClient nowhere =
        CbserveClient.builder()
            .target("127.0.0.1:" + port)
            .defaultTimeout(Duration.ofSeconds(5))
            .build()) {
      // modelInfo is retried (gRPC's retry policy), then fails naming the cause.
      UnavailableException unary = assertThrows(UnavailableException.class, nowhere::modelInfo);
      assertTrue(
          unary.getMessage().toLowerCase(Locale.ROOT).contains("connection refused"),
          unary.getMessage());
      UnavailableException stream =
          assertThrows(UnavailableException.class, () -> nowhere.generate(Prompt.text("hi")));
      assertTrue(
          stream.getMessage().toLowerCase(Locale.ROOT).contains("connection refused"),
          stream.getMessage());
    }
  }

  @Test
  void clientSideChecks() {
    assertThrows(
        IllegalArgumentException.class, () -> SamplingParams.builder().maxNewTokens(-1));
    assertThrows(IllegalArgumentException.class, () -> SamplingParams.builder().maxNewTokens(0));
    assertThrows(IllegalArgumentException.class, () -> Prompt.tokens(1, -2));
    assertThrows(IllegalStateException.class, () -> CbserveClient.builder().build());
    try (CbserveClient noAdmin = CbserveClient.builder().target(server.target).build()) {
      assertThrows(IllegalStateException.class, noAdmin::admin);
    }
    assertTrue(CbserveException.of(Status.Code.INTERNAL, "x") instanceof InternalException);
    assertTrue(CbserveException.ofNumber(8, "full") instanceof ResourceExhaustedException);
    assertEquals(Status.Code.UNIMPLEMENTED, CbserveException.of(Status.Code.UNIMPLEMENTED, "").code());
  }
}
