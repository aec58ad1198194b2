package dev.cbserve.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import cbserve.v1.Generation;
import cbserve.v1.Types;
import io.grpc.stub.ClientCallStreamObserver;
import io.grpc.stub.ClientResponseObserver;
import java.util.ArrayList;
import java.util.List;
import java.util.function.Function;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;

/**
 * Parallel sampling (n &gt; 1) without a server: the interleaved chunks of n sequences assembled
 * into n completions, the end of a stream after every sequence's terminal chunk, the Cancel message
 * of one sequence, and the calls' argument checks (refused before anything reaches the wire).
 */
class SequencesTest {
  /** A client of a port nothing listens on: the checks below throw before any call starts. */
  private static CbserveClient offline;

  @BeforeAll
  static void connect() {
    offline = CbserveClient.builder().target("127.0.0.1:1").build();
  }

  @AfterAll
  static void disconnect() {
    offline.close();
  }

  /** A chunk of sequence {@code index} carrying {@code tokens} from {@code tokenIndex} on. */
  private static Types.GenerationChunk.Builder chunk(
      String requestId, int index, int tokenIndex, int... tokens) {
    Types.GenerationChunk.Builder c =
        Types.GenerationChunk.newBuilder()
            .setRequestId(requestId)
            .setIndex(index)
            .setTokenIndex(tokenIndex)
            .setStatus(Types.RequestStatus.REQUEST_STATUS_DECODING);
    for (int token : tokens) {
      c.addTokenIds(token);
    }
    return c;
  }

  private static Types.GenerationChunk.Builder terminal(
      String requestId, int index, int tokenIndex, Types.FinishReason reason) {
    Types.RequestStatus status =
        reason == Types.FinishReason.FINISH_REASON_CANCELLED
            ? Types.RequestStatus.REQUEST_STATUS_CANCELLED
            : Types.RequestStatus.REQUEST_STATUS_FINISHED;
    return chunk(requestId, index, tokenIndex).setStatus(status).setFinishReason(reason);
  }

  /** Interleaved chunks of a request "r" of n = 3, sequence 1 cancelled after one token. */
  private static List<Types.GenerationChunk> interleaved() {
    Types.FinishReason length = Types.FinishReason.FINISH_REASON_LENGTH;
    return List.of(
        chunk("r", 0, 0).setStatus(Types.RequestStatus.REQUEST_STATUS_QUEUED).build(),
        chunk("r", 1, 0).setStatus(Types.RequestStatus.REQUEST_STATUS_QUEUED).build(),
        chunk("r", 2, 0).setStatus(Types.RequestStatus.REQUEST_STATUS_QUEUED).build(),
        chunk("r", 2, 0, 20).build(),
        chunk("r", 0, 0, 10).build(),
        chunk("r", 1, 0, 15).build(),
        chunk("other", 1, 0, 99).build(), // another request on the same call
        terminal("r", 1, 1, Types.FinishReason.FINISH_REASON_CANCELLED).build(),
        chunk("r", 0, 1, 11).build(),
        terminal("r", 0, 2, length).addTokenIds(12).build(),
        chunk("r", 2, 1, 21, 22).build(),
        terminal("r", 2, 3, length).build());
  }

  @Test
  void interleavedSequencesAssembleIntoCompletionsOrderedByIndex() {
    SequencesBuilder builder = new SequencesBuilder("r", 3);
    List<Types.GenerationChunk> chunks = interleaved();
    for (int i = 0; i < chunks.size(); i++) {
      assertFalse(builder.done(), "done before every sequence ended, at chunk " + i);
      builder.add(Convert.chunk(chunks.get(i)));
    }
    assertTrue(builder.done());
    List<Completion> completions = builder.build();
    assertEquals(3, completions.size());
    for (int i = 0; i < 3; i++) {
      assertEquals(i, completions.get(i).index());
      assertEquals("r", completions.get(i).requestId());
    }
    assertEquals(List.of(10, 11, 12), completions.get(0).tokenIds());
    assertEquals(FinishReason.LENGTH, completions.get(0).finishReason());
    assertEquals(List.of(15), completions.get(1).tokenIds());
    assertEquals(FinishReason.CANCELLED, completions.get(1).finishReason());
    assertEquals(List.of(20, 21, 22), completions.get(2).tokenIds());
    assertEquals(FinishReason.LENGTH, completions.get(2).finishReason());
  }

  @Test
  void aSequenceEndsOnceAndTheRequestOnlyWhenAllHave() {
    SequencesBuilder builder = new SequencesBuilder("r", 2);
    Types.FinishReason length = Types.FinishReason.FINISH_REASON_LENGTH;
    builder.add(Convert.chunk(terminal("r", 0, 0, length).build()));
    // A second terminal chunk of sequence 0 does not count as sequence 1's end.
    builder.add(Convert.chunk(terminal("r", 0, 0, length).build()));
    assertFalse(builder.done());
    // A sequence past n (the caller asked for fewer) is ignored.
    builder.add(Convert.chunk(terminal("r", 2, 0, length).build()));
    assertFalse(builder.done());
    InternalException early = assertThrows(InternalException.class, builder::build);
    assertEquals(
        "the stream of request r ended before its sequence 1 finished", early.details());
    builder.add(Convert.chunk(terminal("r", 1, 0, length).build()));
    assertTrue(builder.done());
    assertEquals(2, builder.build().size());
  }

  /** A ChunkIterator of request "r" and the observer of its call, started (never completed). */
  private record Fed(
      ChunkIterator iterator, ClientResponseObserver<Object, Types.GenerationChunk> call) {
    static Fed start(int sequences) {
      ChunkIterator iterator = new ChunkIterator("r", true, null, sequences);
      ClientResponseObserver<Object, Types.GenerationChunk> call =
          iterator.observer(Function.identity());
      call.beforeStart(new IdleCall());
      return new Fed(iterator, call);
    }
  }

  @Test
  void aStreamEndsAfterTheTerminalChunkOfEverySequence() {
    List<Types.GenerationChunk> chunks = interleaved();
    Fed fed = Fed.start(3);
    chunks.forEach(fed.call()::onNext);
    List<Chunk> read = new ArrayList<>();
    // The call never completes here: the iterator ends on the third sequence's terminal chunk.
    try (ChunkIterator iterator = fed.iterator()) {
      iterator.forEachRemaining(read::add);
      assertFalse(iterator.hasNext());
    }
    assertEquals(chunks.size(), read.size());
    long terminal = read.stream().filter(c -> c.isFinished() && c.requestId().equals("r")).count();
    assertEquals(3, terminal);
    assertEquals(2, read.get(read.size() - 1).index());
  }

  @Test
  void aStreamOfNSequencesDoesNotEndAfterTheFirst() {
    Types.FinishReason length = Types.FinishReason.FINISH_REASON_LENGTH;
    Fed fed = Fed.start(2);
    fed.call().onNext(terminal("r", 0, 0, length).build());
    fed.call().onNext(terminal("r", 0, 0, length).build()); // the same sequence again: counted once
    try (ChunkIterator iterator = fed.iterator()) {
      assertEquals(0, iterator.next().index());
      assertEquals(0, iterator.next().index());
      // Sequence 1 has not ended: its chunks still come (hasNext would wait for them).
      fed.call().onNext(chunk("r", 1, 0, 5).build());
      fed.call().onNext(terminal("r", 1, 1, length).build());
      assertTrue(iterator.hasNext());
      assertEquals(List.of(5), iterator.next().tokenIds());
      assertTrue(iterator.next().isFinished());
      assertFalse(iterator.hasNext());
    }
  }

  @Test
  void aStreamOfUnknownNEndsWithTheCall() {
    Fed fed = Fed.start(0); // results(...), or stream(...) without n: the call's end ends it
    fed.call().onNext(terminal("r", 0, 0, Types.FinishReason.FINISH_REASON_LENGTH).build());
    fed.call().onNext(chunk("r", 1, 0, 7).build());
    fed.call().onCompleted();
    try (ChunkIterator iterator = fed.iterator()) {
      List<Chunk> read = new ArrayList<>();
      iterator.forEachRemaining(read::add);
      assertEquals(2, read.size());
      assertEquals(1, read.get(1).index());
    }
  }

  @Test
  void theCancelOfOneSequenceNamesItsIndex() {
    Generation.CancelRequest one = CbserveClient.cancelMessage("r", 2);
    assertEquals("r", one.getRequestId());
    assertTrue(one.hasIndex());
    assertEquals(2, one.getIndex());
    assertTrue(CbserveClient.cancelMessage("r", 0).hasIndex());
    assertEquals(
        "index must be in [0, 127], got -1",
        assertThrows(IllegalArgumentException.class, () -> offline.cancelSequence("r", -1))
            .getMessage());
    assertThrows(
        IllegalArgumentException.class,
        () -> offline.cancelSequenceAsync("r", SamplingBounds.MAX_N));
    assertThrows(NullPointerException.class, () -> offline.cancelSequence(null, 0));
  }

  @Test
  void generateRefusesNAboveOneAndPointsToGenerateN() {
    SamplingParams three = SamplingParams.builder().maxNewTokens(4).n(3).build();
    IllegalArgumentException e =
        assertThrows(
            IllegalArgumentException.class, () -> offline.generate(Prompt.text("x"), three));
    assertEquals(
        "generate returns one completion, but params set n = 3: call generateN(prompt, 3, params)"
            + " for all 3 (or stream(prompt, params) to read them as they come)",
        e.getMessage());
    IllegalArgumentException async =
        assertThrows(
            IllegalArgumentException.class, () -> offline.generateAsync(Prompt.text("x"), three));
    assertTrue(
        async.getMessage().contains("generateNAsync(prompt, 3, params)"), async.getMessage());
  }

  @Test
  void generateNChecksItsN() {
    SamplingParams params = SamplingParams.builder().maxNewTokens(4).build();
    assertEquals(
        "sampling.n must be an int in [1, 128], got 0",
        assertThrows(
                IllegalArgumentException.class,
                () -> offline.generateN(Prompt.text("x"), 0, params))
            .getMessage());
    assertThrows(
        IllegalArgumentException.class,
        () -> offline.generateNAsync(Prompt.text("x"), SamplingBounds.MAX_N + 1, params));
    SamplingParams four = SamplingParams.builder().n(4).build();
    assertEquals(
        "generateN was asked for n = 3, but params set n = 4 (leave n unset in params, or pass the"
            + " same value)",
        assertThrows(
                IllegalArgumentException.class,
                () -> offline.generateN(Prompt.text("x"), 3, four))
            .getMessage());
    assertThrows(
        NullPointerException.class, () -> offline.generateN(Prompt.text("x"), 2, null));
  }

  /** A call that takes the iterator's requests for more messages and does nothing else. */
  private static final class IdleCall extends ClientCallStreamObserver<Object> {
    @Override
    public void cancel(String message, Throwable cause) {}

    @Override
    public boolean isReady() {
      return true;
    }

    @Override
    public void setOnReadyHandler(Runnable onReadyHandler) {}

    @Override
    public void disableAutoInboundFlowControl() {}

    @Override
    public void disableAutoRequestWithInitial(int request) {}

    @Override
    public void request(int count) {}

    @Override
    public void setMessageCompression(boolean enable) {}

    @Override
    public void onNext(Object value) {}

    @Override
    public void onError(Throwable t) {}

    @Override
    public void onCompleted() {}
  }
}
