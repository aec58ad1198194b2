package dev.cbserve.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.grpc.Status;
import java.io.IOException;
import java.net.InetAddress;
import java.net.ServerSocket;
import java.time.Duration;
import java.util.Arrays;
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
  void stopStringsOutsideTheServerBoundsAreInvalidArgument() {
    // The client leaves these bounds to the server: the request must still be refused.
    SamplingParams empty = SamplingParams.builder().maxNewTokens(4).stop("").build();
    InvalidArgumentException e =
        assertThrows(InvalidArgumentException.class, () -> client.generate(Prompt.text("hi"), empty));
    assertTrue(e.details().contains("stop"), e.details());
    String[] seventeen = new String[17];
    Arrays.fill(seventeen, "x");
    SamplingParams tooMany = SamplingParams.builder().maxNewTokens(4).stop(seventeen).build();
    assertThrows(InvalidArgumentException.class, () -> client.submit(Prompt.text("hi"), tooMany));
  }

  @Test
  void presencePenaltyOutsideTheServerBoundsIsInvalidArgument() {
    // The client leaves the [-2, 2] bound to the server: the request must still be refused.
    SamplingParams tooHigh = SamplingParams.builder().maxNewTokens(4).presencePenalty(3).build();
    InvalidArgumentException e =
        assertThrows(
            InvalidArgumentException.class, () -> client.generate(Prompt.text("hi"), tooHigh));
    assertEquals(Status.Code.INVALID_ARGUMENT, e.code());
    assertTrue(e.details().contains("presence_penalty"), e.details());
    InvalidArgumentException submitted =
        assertThrows(InvalidArgumentException.class, () -> client.submit(Prompt.text("hi"), tooHigh));
    assertTrue(submitted.details().contains("presence_penalty"), submitted.details());
  }

  @Test
  void logitBiasOutsideTheServerBoundsIsInvalidArgument() {
    // The client leaves the [-100, 100] bound to the server: the request must still be refused.
    SamplingParams tooHigh =
        SamplingParams.builder().maxNewTokens(4).logitBias(Map.of(1, 150.0)).build();
    InvalidArgumentException e =
        assertThrows(
            InvalidArgumentException.class, () -> client.generate(Prompt.text("hi"), tooHigh));
    assertEquals(Status.Code.INVALID_ARGUMENT, e.code());
    assertTrue(e.details().contains("logit_bias"), e.details());
    InvalidArgumentException submitted =
        assertThrows(InvalidArgumentException.class, () -> client.submit(Prompt.text("hi"), tooHigh));
    assertTrue(submitted.details().contains("logit_bias"), submitted.details());
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
      assertThrows(DeadlineExceededException.class, () -> drainTokens(chunks, 0));
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
      assertThrows(UnavailableException.class, nowhere::modelInfo);
      assertThrows(UnavailableException.class, () -> nowhere.generate(Prompt.text("hi")));
    }
  }

  @Test
  void clientSideChecks() {
    assertThrows(
        IllegalArgumentException.class, () -> SamplingParams.builder().maxNewTokens(-1));
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
