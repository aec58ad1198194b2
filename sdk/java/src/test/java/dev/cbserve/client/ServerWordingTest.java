package dev.cbserve.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNotEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import cbserve.v1.Generation;
import cbserve.v1.GenerationServiceGrpc;
import cbserve.v1.Types;
import io.grpc.Grpc;
import io.grpc.InsecureChannelCredentials;
import io.grpc.ManagedChannel;
import io.grpc.Status;
import io.grpc.StatusRuntimeException;
import java.io.IOException;
import java.net.InetAddress;
import java.net.ServerSocket;
import java.time.Duration;
import java.util.Arrays;
import java.util.Map;
import java.util.concurrent.TimeUnit;
import java.util.function.UnaryOperator;
import java.util.stream.IntStream;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.function.Executable;

/**
 * One mistake reads the same from every SDK and from the server: the builders refuse a value with
 * the live server's own message for it, naming the wire field; a passed deadline says which
 * deadline and what sets it; every status code has its exception type.
 */
class ServerWordingTest extends ServerTest {

  /** The builder's refusal of a value, and the same value put on the wire past the builder. */
  private record Case(
      String name, Executable builder, UnaryOperator<Types.SamplingParams.Builder> wire) {}

  @Test
  void theBuildersRefuseAValueWithTheServersMessage() throws Exception {
    String[] seventeen = new String[SamplingBounds.MAX_STOP_STRINGS + 1];
    Arrays.fill(seventeen, "x");
    Map<Integer, Double> biases = new java.util.HashMap<>();
    IntStream.rangeClosed(0, SamplingBounds.MAX_LOGIT_BIAS_ENTRIES)
        .forEach(id -> biases.put(id, 1.0));
    int[] stopIds = new int[SamplingBounds.MAX_STOP_TOKEN_IDS + 1];
    Case[] cases = {
      new Case("max_new_tokens", () -> SamplingParams.builder().maxNewTokens(0),
          s -> s.setMaxNewTokens(0)),
      new Case("temperature", () -> SamplingParams.builder().temperature(-1),
          s -> s.setTemperature(-1)),
      new Case("top_p", () -> SamplingParams.builder().topP(0), s -> s.setTopP(0)),
      new Case("top_logprobs", () -> SamplingParams.builder().topLogprobs(21),
          s -> s.setLogprobs(true).setTopLogprobs(21)),
      new Case("repetition_penalty", () -> SamplingParams.builder().repetitionPenalty(0),
          s -> s.setRepetitionPenalty(0)),
      new Case("presence_penalty", () -> SamplingParams.builder().presencePenalty(2.5),
          s -> s.setPresencePenalty(2.5f)),
      new Case("frequency_penalty", () -> SamplingParams.builder().frequencyPenalty(-2.5),
          s -> s.setFrequencyPenalty(-2.5f)),
      new Case("min_p", () -> SamplingParams.builder().minP(1.5), s -> s.setMinP(1.5f)),
      new Case("logit_bias value", () -> SamplingParams.builder().logitBias(Map.of(7, 100.5)),
          s -> s.putLogitBias(7, 100.5f)),
      new Case("logit_bias entries", () -> SamplingParams.builder().logitBias(biases),
          s -> {
            biases.keySet().forEach(id -> s.putLogitBias(id, 1f));
            return s;
          }),
      new Case("stop strings", () -> SamplingParams.builder().stop(seventeen),
          s -> s.addAllStop(Arrays.asList(seventeen))),
      new Case("stop string length", () -> SamplingParams.builder().stop("x", "y".repeat(257)),
          s -> s.addStop("x").addStop("y".repeat(257))),
      new Case("stop_token_ids", () -> SamplingParams.builder().stopTokenIds(stopIds),
          s -> {
            Arrays.stream(stopIds).forEach(s::addStopTokenIds);
            return s;
          }),
      new Case("prompt_logprobs", () -> SamplingParams.builder().promptLogprobs(21),
          s -> s.setPromptLogprobs(21)),
      new Case("n", () -> SamplingParams.builder().n(SamplingBounds.MAX_N + 1),
          s -> s.setN(SamplingBounds.MAX_N + 1)),
      new Case("min_new_tokens above max_new_tokens",
          () -> SamplingParams.builder().maxNewTokens(4).minNewTokens(5).build(),
          s -> s.setMinNewTokens(5)),
    };
    ManagedChannel channel =
        Grpc.newChannelBuilder(server.target, InsecureChannelCredentials.create()).build();
    try {
      var stub =
          GenerationServiceGrpc.newBlockingStub(channel).withDeadlineAfter(60, TimeUnit.SECONDS);
      for (Case c : cases) {
        String client = assertThrows(IllegalArgumentException.class, c.builder()).getMessage();
        Types.SamplingParams.Builder sampling =
            c.wire().apply(Types.SamplingParams.newBuilder().setMaxNewTokens(4));
        Types.GenerationRequest request =
            Types.GenerationRequest.newBuilder().setText("hi").setSampling(sampling).build();
        StatusRuntimeException refused =
            assertThrows(
                StatusRuntimeException.class,
                () ->
                    stub.addRequest(
                        Generation.AddRequestRequest.newBuilder().setRequest(request).build()),
                c.name() + ": the server took the value");
        assertEquals(Status.Code.INVALID_ARGUMENT, refused.getStatus().getCode(), c.name());
        assertEquals(refused.getStatus().getDescription(), client, c.name());
      }
    } finally {
      channel.shutdownNow();
    }
  }

  @Test
  void aDeadlineThatPassesBeforeTheConnectionIsUpSaysWhichDeadline() throws IOException {
    // A socket that accepts connections and never speaks HTTP/2: the calls wait for a
    // connection until their deadline.
    try (ServerSocket silent = new ServerSocket(0, 50, InetAddress.getByName("127.0.0.1"));
        CbserveClient client =
            CbserveClient.builder()
                .target("127.0.0.1:" + silent.getLocalPort())
                .defaultTimeout(Duration.ofMillis(300))
                .streamTimeout(Duration.ofMillis(400))
                .build()) {
      DeadlineExceededException unary =
          assertThrows(DeadlineExceededException.class, client::modelInfo);
      assertEquals(
          "DEADLINE_EXCEEDED: the call's deadline of 300 ms (the client's defaultTimeout) passed;"
              + " pass defaultTimeout(...) to the client's builder for a longer one (null: none)",
          unary.getMessage());
      DeadlineExceededException stream =
          assertThrows(
              DeadlineExceededException.class, () -> client.generate(Prompt.text("hi"), greedy(2)));
      assertEquals(
          "DEADLINE_EXCEEDED: the call's deadline of 400 ms (the client's streamTimeout) passed;"
              + " pass RequestOptions.timeout(...) to the call, or streamTimeout(...) to the"
              + " client's builder, for a longer one (null: none)",
          stream.getMessage());
      RequestOptions perCall = RequestOptions.builder().timeout(Duration.ofMillis(200)).build();
      DeadlineExceededException own =
          assertThrows(
              DeadlineExceededException.class,
              () -> client.generate(Prompt.text("hi"), greedy(2), perCall));
      assertTrue(
          own.getMessage().startsWith("DEADLINE_EXCEEDED: the call's deadline of 200 ms"
              + " (RequestOptions.timeout) passed"),
          own.getMessage());
    }
  }

  @Test
  void aRefusedConnectionNamesTheCauseOnly() throws IOException {
    int port;
    try (ServerSocket socket = new ServerSocket(0, 1, InetAddress.getByName("127.0.0.1"))) {
      port = socket.getLocalPort();
    }
    try (CbserveClient nowhere =
        CbserveClient.builder()
            .target("127.0.0.1:" + port)
            .defaultTimeout(Duration.ofSeconds(5))
            .build()) {
      UnavailableException e = assertThrows(UnavailableException.class, nowhere::modelInfo);
      assertEquals(
          "UNAVAILABLE: io exception: Connection refused: /127.0.0.1:" + port, e.getMessage());
    }
  }

  @Test
  void everyStatusCodeHasAnExceptionTypeOfItsOwn() {
    for (Status.Code code : Status.Code.values()) {
      if (code == Status.Code.OK) {
        continue;
      }
      CbserveException e = CbserveException.of(code, "x");
      assertNotEquals(CbserveException.class, e.getClass(), code + " has no type of its own");
      assertEquals(code, e.code());
    }
    assertEquals(
        PermissionDeniedException.class,
        CbserveException.of(Status.Code.PERMISSION_DENIED, "").getClass());
    assertEquals(
        UnimplementedException.class,
        CbserveException.of(Status.Code.UNIMPLEMENTED, "").getClass());
    assertEquals(AbortedException.class, CbserveException.of(Status.Code.ABORTED, "").getClass());
    assertEquals(
        OutOfRangeException.class, CbserveException.of(Status.Code.OUT_OF_RANGE, "").getClass());
  }

  @Test
  void floatsAreWrittenAsTheServerWritesThem() {
    assertEquals("-1.0", ServerWording.pythonFloat(-1));
    assertEquals("0.5", ServerWording.pythonFloat(0.5));
    assertEquals("0.0001", ServerWording.pythonFloat(1e-4));
    assertEquals("1e-05", ServerWording.pythonFloat(1e-5));
    assertEquals("1.5e+16", ServerWording.pythonFloat(1.5e16));
    assertEquals("123456789.0", ServerWording.pythonFloat(123456789));
    assertEquals("nan", ServerWording.pythonFloat(Double.NaN));
    assertEquals("-inf", ServerWording.pythonFloat(Double.NEGATIVE_INFINITY));
  }
}
